"""What a model's products may take their inputs as, and the default: names only, without the kernels
(activations.py), so the command line's options read them without loading numba."""

ACTIVATIONS = ("f32", "q8", "mixed")
# The default: the fastest mode whose fidelity holds. Its logits lie nearer the exact model's than
# llama.cpp's on every reference text, its greedy replies are llama.cpp's and prompt lookup's tokens the
# plain decode's (tests/test_real_models.py); it prefills faster than "mixed" and decodes as fast
# (docs/performance.md, "Inputs as bytes").
DEFAULT_ACTIVATIONS = "q8"
