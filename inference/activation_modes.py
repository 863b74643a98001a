"""What a model's products may take their inputs as, and the default: names only, without the kernels
(activations.py), so the command line's options read them without loading numba."""

ACTIVATIONS = ("f32", "q8", "mixed")
# The default: its logits lie nearer the exact model's than llama.cpp's on every reference text and its
# greedy replies are llama.cpp's (activations.py; docs/benchmarks.md, "Agreement with llama.cpp").
DEFAULT_ACTIVATIONS = "mixed"
