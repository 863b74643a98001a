"""The forward pass on tiny models of every architecture, and the errors bad model files give."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llama_chat.app.cli import main
from llama_chat.inference import ModelError, blas_crossover, forward, kernels, load_model
from llama_chat.inference.forward import rope
from tiny_models import write_tiny_model


def test_every_architecture_loads_and_runs(tiny_model_path):
    model = load_model(tiny_model_path)
    ids = model.tokenizer.encode("hello the world, it is a test")
    logits = model.logits(ids)
    assert logits.shape == (len(ids), model.config.n_vocab)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()


# float32: the cache holds the KV as computed, and two orders of the same sums agree to float32
# rounding; float16 (the default): such a difference may also move a cached value to the next float16
# (2^-11 relative), which later tokens read. Products computed exactly (--activations f32): with inputs as
# bytes such a difference may round an input to the next step of its scale (0.01-0.03 on these models).
CACHE_TYPES = pytest.mark.parametrize("cache_type, tolerance", [("f32", 1e-4), ("f16", 2e-3)])


@CACHE_TYPES
def test_prefill_then_decode_equals_one_long_prefill(tiny_model_path, cache_type, tolerance):
    model = load_model(tiny_model_path, cache_type=cache_type, activations="f32")
    ids = model.tokenizer.encode("the hello world is in the air, then the water and the sun " * 2)
    assert len(ids) > 20  # long enough to cross gemma3's sliding window of 8 in the tiny model
    full = model.logits(ids)
    cache = model.new_sequence(len(ids))
    steps = [model.forward(ids[:7], cache, all_logits=True)]
    steps.append(model.forward(ids[7:12], cache, all_logits=True))
    steps += [model.forward([t], cache) for t in ids[12:]]
    stepwise = np.concatenate(steps)
    k, v = cache.gather(0, cache.n_tokens)
    assert k.dtype == v.dtype == {"f32": np.float32, "f16": np.float16}[cache_type]
    assert stepwise.dtype == np.float32
    assert np.abs(stepwise - full).max() <= tolerance


def test_prefill_of_last_logits_equals_all_logits(tiny_model_path):
    """forward() computes the last layer for the last row only; that row must not change (sliding
    windows included: the prompt is longer than gemma3's window of 8)."""
    model = load_model(tiny_model_path)
    ids = model.tokenizer.encode("the hello world is in the air, then the water and the sun " * 2)
    seq = model.new_sequence(len(ids))
    last = model.forward(ids, seq)
    assert last.shape == (1, model.config.n_vocab)
    assert np.abs(last - model.logits(ids)[-1:]).max() <= 1e-4


def test_attention_in_groups_of_rows_equals_all_rows_at_once(tiny_model_path, monkeypatch):
    """A long prefill attends in groups of ATTENTION_ROWS rows, each reading keys only up to its last
    row; groups of 5 rows (several per prompt, across gemma3's window of 8) must equal one group."""
    model = load_model(tiny_model_path)
    ids = model.tokenizer.encode("the hello world is in the air, then the water and the sun " * 2)
    monkeypatch.setattr(forward, "ATTENTION_ROWS", 10_000)
    whole = model.logits(ids)
    monkeypatch.setattr(forward, "ATTENTION_ROWS", 5)
    grouped = model.logits(ids)
    assert np.abs(grouped - whole).max() <= 1e-5


def test_cache_reuse_after_truncate_equals_fresh_prefill(tiny_model_path):
    model = load_model(tiny_model_path)
    ids = model.tokenizer.encode("hello the world and the sun")
    cache = model.new_sequence(64)
    model.forward(ids, cache)
    cache.truncate(3)  # as when a later message is edited
    other = model.tokenizer.encode(" is it")
    resumed = model.forward(other, cache)
    fresh = model.logits(ids[:3] + other)[-1:]
    assert np.abs(resumed - fresh).max() <= 1e-4


def test_sliding_window_limits_what_gemma3_sees(tiny_model_paths):
    """Changing a token far outside the window changes nothing on sliding layers; it must change the
    output through the global layer, so the model really attends beyond the window there."""
    model = load_model(tiny_model_paths["gemma3"])
    assert model.config.sliding_window == 8
    assert [model.config.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    ids = model.tokenizer.encode("hello the world is in the air and the sun and the water")
    changed = list(ids)
    changed[1] = model.tokenizer.encode("q")[0]
    assert np.abs(model.logits(ids)[-1] - model.logits(changed)[-1]).max() > 1e-4


def test_rope_shift_is_a_second_rotation():
    """RoPE is a rotation: rotating by p then by -d equals rotating by p - d (what context shift uses)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    pos = np.arange(10, 15)
    for neox in (True, False):
        twice = rope(rope(x, pos, 10000.0, neox, None), np.full(5, -4), 10000.0, neox, None)
        once = rope(x, pos - 4, 10000.0, neox, None)
        assert np.abs(twice - once).max() < 1e-4


def _error_line(capsys, path) -> str:
    code = main(["--model", str(path), "tokenize", "hello"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert str(path) in err
    return err


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("truncated", "truncated"),
        ("random", "not a GGUF file"),
        ("wrong magic", "not a GGUF file"),
        ("header only", "truncated"),
        ("unknown architecture", "unsupported architecture 'mamba9'"),
        ("missing tensor", "missing tensor blk.1.ffn_up.weight"),
        ("wrong shape", "tensor blk.0.attn_q.weight has shape [32, 64], expected [64, 64]"),
        ("unsupported quant", "unsupported quantization type Q8_1"),
    ],
)
def test_bad_model_files_give_one_clear_line(tmp_path, capsys, kind, expected):
    path = tmp_path / "bad.gguf"
    good = write_tiny_model(tmp_path / "good.gguf", "qwen2")
    data = good.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "header only":
        path.write_bytes(data[:24])
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(50_000))
    elif kind == "wrong magic":
        path.write_bytes(b"GGML" + data[4:])
    elif kind == "unknown architecture":
        write_tiny_model(path, "qwen2", arch_name="mamba9")
    elif kind == "missing tensor":
        write_tiny_model(path, "qwen2", drop="blk.1.ffn_up.weight")
    elif kind == "wrong shape":
        write_tiny_model(path, "qwen2", shapes={"blk.0.attn_q.weight": (32, 64)})
    elif kind == "unsupported quant":
        write_tiny_model(path, "qwen2", raw_types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1})
    line = _error_line(capsys, path)
    assert expected in line
    assert "Traceback" not in line


def test_missing_path_and_unknown_name(tmp_path, capsys):
    assert "no such file" in _error_line(capsys, tmp_path / "nope.gguf")
    assert main(["--model", "no-such-model", "tokenize", "x"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_load_model_raises_model_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(path)


def test_a_load_removes_the_float32_weights_older_versions_prepared(tiny_model_paths):
    """Older versions kept a 2.4 GB float32 copy of each model's weights in the cache: gone on first load."""
    from llama_chat.inference.catalog import cache_dir

    old = cache_dir() / "prepared" / "0123456789abcdef01234567"
    old.mkdir(parents=True)
    (old / "info.json").write_text('{"config": {}, "weights": ["token_embd"]}')
    (old / "token_embd.npy").write_bytes(b"\0" * 4096)
    model = load_model(tiny_model_paths["qwen2"])
    assert not old.exists()
    kept = [entry for entry in (cache_dir() / "prepared").iterdir() if entry.is_dir()]
    assert len(kept) == 1 and not list(kept[0].glob("*.npy"))  # metadata only (packed weights beside it)
    assert model.logits(model.tokenizer.encode("hello")).shape[1] == model.config.n_vocab


def test_a_prompts_attention_split_over_threads_equals_it_whole(tiny_model_path, monkeypatch):
    """In a step of the kernels, a long prompt's attention is split by query rows over the threads:
    its logits agree with the attention computed whole (gemma3's sliding windows included)."""
    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda progress=None: None)  # the kernels take
    monkeypatch.setattr(kernels, "blas_from", None)  # every step, whatever this machine measured
    monkeypatch.setattr(forward, "TILE_DIMS", 10**9)  # BLAS's attention: heads rows_attention does not take
    model = load_model(tiny_model_path)
    ids = model.tokenizer.encode("the hello world is in the air, then the water and the sun " * 6)[:200]
    splits = []
    in_parallel = kernels.in_parallel
    monkeypatch.setattr(kernels, "in_parallel", lambda tasks: splits.append(len(tasks)) or in_parallel(tasks))
    monkeypatch.setattr(kernels.numba.config, "NUMBA_NUM_THREADS", 3)  # three parts, on any machine

    def prefilled(split_from: int) -> np.ndarray:
        monkeypatch.setattr(kernels, "PARALLEL_ATTENTION_FROM", split_from)
        seq = model.new_sequence(len(ids))
        model.forward(ids[:40], seq)
        return model.forward(ids[40:], seq, all_logits=True)

    whole = prefilled(10**9)
    assert not splits
    split = prefilled(1)
    assert splits and set(splits) == {3}
    assert np.abs(split - whole).max() <= 1e-4


def test_a_prompts_attention_by_the_rows_kernel_equals_blas(tiny_model_path, monkeypatch):
    """A prompt's rows attend in one compiled call (attention.rows_attention): the logits of every row
    agree with BLAS's attention (gemma3's sliding windows, gemma2's soft cap and gpt-oss's sinks
    included)."""
    model = load_model(tiny_model_path, cache_type="f32", activations="f32")
    ids = model.tokenizer.encode("the hello world is in the air, then the water and the sun " * 3)
    by_kernel = model.logits(ids)
    monkeypatch.setattr(forward, "TILE_DIMS", 10**9)  # heads rows_attention does not take: BLAS's
    assert np.abs(by_kernel - model.logits(ids)).max() <= 1e-4


@CACHE_TYPES
def test_one_token_attention_by_the_kernels_equals_blas(tiny_model_path, monkeypatch, cache_type, tolerance):
    """Decoding past KERNEL_ATTENTION_FROM cached positions, a token's attention is computed by the
    compiled kernels instead of BLAS: the logits agree (gemma3's sliding windows included), over a
    cache of either type."""
    model = load_model(tiny_model_path, cache_type=cache_type, activations="f32")
    ids = model.tokenizer.encode("the hello world is in the air, then the water and the sun " * 2)
    monkeypatch.setattr(forward, "TILE_DIMS", 10**9)  # the rest BLAS's, not rows_attention's
    calls = []  # a row per token the kernels attend for
    by_kernels = kernels.tokens_attention
    monkeypatch.setattr(kernels, "tokens_attention", lambda q, *args: calls.extend(q) or by_kernels(q, *args))

    def decoded(kernels_from: int) -> np.ndarray:
        monkeypatch.setattr(forward, "KERNEL_ATTENTION_FROM", kernels_from)
        seq = model.new_sequence(len(ids))
        model.forward(ids[:5], seq)
        return np.concatenate([model.forward([t], seq) for t in ids[5:]])

    with_blas = decoded(10**9)
    assert not calls
    with_kernels = decoded(1)
    if model.config.attn_logit_softcap:  # (gemma2) the kernel does not soft-cap scores: BLAS takes them
        assert not calls and np.abs(with_kernels - with_blas).max() <= tolerance
        return
    # every layer of every decoded token, and the prompt's last row in the last layer (the only row
    # computed there)
    assert len(calls) == (len(ids) - 5) * model.config.n_layer + 1
    assert np.abs(with_kernels - with_blas).max() <= tolerance
