"""The paged KV cache: prefix sharing, fork, truncate, eviction, context shift, batched decode."""

from __future__ import annotations

import numpy as np
import pytest

from llama_chat.inference import (
    GenerationStats,
    SamplingParams,
    forward,
    generate,
    generate_alternatives,
    kernels,
    load_model,
)
from llama_chat.inference.kernels import DEFAULT_ACTIVATIONS, KERNEL_ROWS
from llama_chat.inference.kv_cache import CacheFullError
from tiny_models import write_tiny_model

B = 8  # a small block size, so tiny prompts span several blocks


# Two computations of the same logits differ by float32 rounding (a different order of sums); in a
# float16 cache such a difference may also move a cached value to the next float16 (2^-11 relative),
# and that shows in later tokens: each comparison is made with the exact float32 cache at its tight
# bound and with the default float16 cache at a bound that leaves room for that.
CACHE_TYPES = pytest.mark.parametrize("cache_type, slack", [("f32", 1.0), ("f16", 20.0)])


def tiny(
    path,
    ram_blocks: int = 64,
    arch_block: int = B,
    cache_type: str = "f16",
    activations: str = DEFAULT_ACTIVATIONS,
):
    model = load_model(path, block_size=arch_block, cache_type=cache_type, activations=activations)
    model.pool.__init__(
        model.config,
        model.fingerprint,
        arch_block,
        ram_blocks * model.pool.block_bytes / 2**20,
        cache_type=cache_type,
    )
    return model


@pytest.fixture
def model(tiny_model_path):
    return tiny(tiny_model_path)


def ids_of(model, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 200, size=n)]


@CACHE_TYPES
def test_prefix_reuse_gives_the_same_logits_as_a_full_prefill(tiny_model_path, cache_type, slack):
    # (products computed exactly: with inputs as bytes the reused KV's last-bit difference may round an
    # input to the next step of its scale, 0.02 on the tiny gemma3)
    model = tiny(tiny_model_path, cache_type=cache_type, activations="f32")
    shared = ids_of(model, 3 * B + 5)
    first = model.new_sequence(128)
    model.forward(shared + ids_of(model, 4, seed=1), first)
    second = model.new_sequence(128)
    prompt = shared + ids_of(model, 6, seed=2)
    held = second.reuse_prefix(prompt)
    assert held == 3 * B  # the full blocks of the common prefix, not its partial tail
    assert second.blocks == first.blocks[:3]
    reused = model.forward(prompt[held:], second, all_logits=True)
    fresh = model.logits(prompt)[held:]
    assert np.abs(reused - fresh).max() <= 1e-4 * slack


def test_the_pool_names_the_blocks_a_prompt_would_reuse_and_those_ram_lacks(model):
    shared = ids_of(model, 3 * B + 5)
    keys = model.pool.block_keys(shared)
    assert len(keys) == 3 and len(set(keys)) == 3  # full blocks only, each named by its whole prefix
    assert model.pool.block_keys(shared[: 2 * B]) == keys[:2]
    assert model.pool.block_keys(ids_of(model, 3 * B, seed=1))[0] != keys[0]
    assert [key for key, _ in model.pool.missing(shared)] == keys  # nothing computed yet
    seq = model.new_sequence(128)
    model.forward(shared[: 2 * B + 1], seq)
    assert seq.last_key is None  # its last block is partial
    assert model.pool.missing(shared) == [(keys[2], tuple(shared[2 * B : 3 * B]))]
    assert len(model.pool.missing(shared, namespace=b"an import")) == 3  # another namespace shares nothing
    seq.truncate(2 * B)
    assert seq.last_key == keys[1]


def test_a_sequence_made_private_or_in_a_namespace_takes_no_shared_block(model):
    prompt = ids_of(model, 2 * B + 3)
    model.forward(prompt, model.new_sequence(64))
    assert model.new_sequence(64).reuse_prefix(prompt) == 2 * B
    assert model.new_sequence(64, private=True).reuse_prefix(prompt) == 0
    imported = model.new_sequence(64, namespace=b"an import")
    assert imported.reuse_prefix(prompt) == 0
    assert imported.fork().namespace == b"an import" and model.new_sequence(64, private=True).fork().private


def test_the_same_code_path_gives_bitwise_equal_logits(model):
    prompt = ids_of(model, 2 * B + 3)
    a = model.new_sequence(64)
    la = model.forward(prompt, a)
    b = model.new_sequence(64)
    b.reuse_prefix(prompt[: 2 * B])
    assert b.n_tokens == 2 * B
    lb = model.forward(prompt[2 * B :], b)
    c = model.new_sequence(64)
    model.forward(prompt[: 2 * B], c)
    lc = model.forward(prompt[2 * B :], c)
    assert np.array_equal(lb, lc)
    assert np.abs(la - lb).max() <= 1e-4


def test_kv_written_comes_back_as_written_whichever_way_it_is_read(model):
    """The arena holds keys by block ([head_dim, B]) and values by row: what a sequence writes (a prompt's
    rows, then single tokens) reads back the same as rows, as a block's view, through a step's views,
    and after a fork's copy-on-write of a shared partial block."""
    cfg, pool = model.config, model.pool
    rng = np.random.default_rng(9)
    n = 2 * B + 3
    k, v = (rng.standard_normal((cfg.n_layer, cfg.n_head_kv, n + 2, cfg.head_dim)).astype(np.float16)
            for _ in range(2))
    seq = model.new_sequence(64)
    seq.append_kv(list(range(n)), k[:, :, :n], v[:, :, :n])  # several rows at once
    child = seq.fork()
    for t in (n, n + 1):  # one token at a time, into the shared partial block: copied first
        child.append_kv([t], k[:, :, t : t + 1], v[:, :, t : t + 1])
    for s, m in ((seq, n), (child, n + 2)):
        got_k, got_v = s.gather(0, m)
        assert np.array_equal(got_k, k[:, :, :m]) and np.array_equal(got_v, v[:, :, :m])
        views = s.views(3, m)
        for layer in range(cfg.n_layer):
            pieces = views.layer(layer)
            assert np.array_equal(np.concatenate([a for a, _ in pieces], axis=1), k[layer, :, 3:m])
            assert np.array_equal(np.concatenate([b for _, b in pieces], axis=1), v[layer, :, 3:m])
    block_k, block_v = pool.block_kv(seq.blocks[1])
    assert np.array_equal(block_k, k[:, :, B : 2 * B]) and np.array_equal(block_v, v[:, :, B : 2 * B])


def test_fork_then_diverge_leaves_the_parent_unchanged(model):
    prompt = ids_of(model, 2 * B + 3)  # ends inside a partial block, which both will write to
    parent = model.new_sequence(64)
    model.forward(prompt, parent)
    before = model.pool.memory_breakdown()
    child = parent.fork()
    after = model.pool.memory_breakdown()
    assert after["in_use_bytes"] == before["in_use_bytes"]  # no KV copied
    assert after["shared_bytes"] == len(parent.blocks) * model.pool.block_bytes
    model.forward(ids_of(model, 5, seed=3), child)  # copy-on-write of the shared partial block
    nxt = ids_of(model, 2, seed=4)
    assert np.abs(model.forward(nxt, parent) - model.logits(prompt + nxt)[-1:]).max() <= 1e-4


def test_truncate_inside_a_shared_block_then_continue_equals_fresh_prefill(tiny_model_path):
    model = tiny(tiny_model_path, activations="f32")  # (as above: products computed exactly)
    prompt = ids_of(model, 3 * B)
    seq = model.new_sequence(64)
    model.forward(prompt, seq)
    other = model.new_sequence(64)
    other.reuse_prefix(prompt)  # shares all three full blocks
    seq.truncate(B + 3)  # cut into a full, registered block that `other` still uses
    tail = ids_of(model, 4, seed=5)
    assert np.abs(model.forward(tail, seq) - model.logits(prompt[: B + 3] + tail)[-1:]).max() <= 1e-4
    # the block `other` reads was not written over
    more = ids_of(model, 2, seed=6)
    assert np.abs(model.forward(more, other) - model.logits(prompt + more)[-1:]).max() <= 1e-4


def test_lru_eviction_never_drops_a_block_a_live_sequence_uses(tiny_model_paths):
    model = tiny(tiny_model_paths["qwen2"], ram_blocks=8)
    live = model.new_sequence(64)
    prompt = ids_of(model, 3 * B)
    model.forward(prompt, live)
    for seed in range(10):  # churn: finished conversations leave cached blocks behind
        tmp = model.new_sequence(64)
        model.forward(ids_of(model, 2 * B, seed=100 + seed), tmp)
        tmp.free()
        breakdown = model.pool.memory_breakdown()
        assert breakdown["in_use_bytes"] + breakdown["cached_bytes"] <= breakdown["budget_bytes"]
    more = ids_of(model, 3, seed=7)
    assert np.abs(model.forward(more, live) - model.logits(prompt + more)[-1:]).max() <= 1e-4


def test_a_full_pool_is_a_clear_error(tiny_model_paths):
    model = tiny(tiny_model_paths["qwen2"], ram_blocks=3)
    seq = model.new_sequence(64)
    with pytest.raises(CacheFullError, match="KV cache full"):
        model.forward(ids_of(model, 4 * B), seq)


def test_fork_is_constant_time_and_free(model):
    seq = model.new_sequence(256)
    model.forward(ids_of(model, 200), seq)
    used = model.pool.memory_breakdown()["in_use_bytes"]
    forks = [seq.fork() for _ in range(5)]
    assert model.pool.memory_breakdown()["in_use_bytes"] == used
    assert all(f.tokens == seq.tokens for f in forks)


@CACHE_TYPES
def test_context_shift_equals_a_fresh_prefill_of_the_shortened_text(tmp_path, cache_type, slack):
    """With one layer, a token's K and V depend only on the token and its position, so re-rotating the
    kept keys must reproduce a fresh prefill exactly (deeper models get llama.cpp's approximation)."""
    model = tiny(write_tiny_model(tmp_path / "one.gguf", "qwen2", n_layer=1), cache_type=cache_type)
    system, old, recent = ids_of(model, 5, 1), ids_of(model, 13, 2), ids_of(model, 9, 3)
    seq = model.new_sequence(64)
    model.forward(system + old + recent, seq)
    model.context_shift(seq, keep=len(system), drop=len(old))
    assert seq.tokens == system + recent
    nxt = ids_of(model, 3, 4)
    assert (
        np.abs(model.forward(nxt, seq, all_logits=True) - model.logits(system + recent + nxt)[-3:]).max()
        <= 1e-3 * slack
    )


@CACHE_TYPES
def test_context_shift_keeps_gemma3_and_llama_rotations_right(tmp_path, cache_type, slack):
    for arch in ("gemma3", "llama"):
        model = tiny(write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_layer=1), cache_type=cache_type)
        a, b, c = ids_of(model, 4, 1), ids_of(model, 6, 2), ids_of(model, 5, 3)
        seq = model.new_sequence(64)
        model.forward(a + b + c, seq)
        model.context_shift(seq, keep=len(a), drop=len(b))
        nxt = ids_of(model, 2, 4)
        assert np.abs(model.forward(nxt, seq) - model.logits(a + c + nxt)[-1:]).max() <= 1e-3 * slack


def test_batched_decode_equals_one_sequence_at_a_time(model):
    prompt = ids_of(model, 2 * B + 1)
    base = model.new_sequence(64)
    model.forward(prompt, base)
    seqs = [base.fork() for _ in range(3)]
    tokens = [5, 17, 42]
    together = model.decode_batch(tokens, seqs)
    for t, row in zip(tokens, together, strict=True):
        assert np.abs(row - model.logits(prompt + [t])[-1]).max() <= 1e-4


def test_alternatives_are_generated_together_and_match_single_runs(model):
    prompt = ids_of(model, 12)
    sampling = SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)  # flat: replies differ
    alternatives = generate_alternatives(model, prompt, 3, sampling=sampling, max_tokens=6)
    assert len({tuple(a.stats.token_ids) for a in alternatives}) > 1
    for i, alt in enumerate(alternatives):
        single = GenerationStats()
        text = "".join(
            generate(
                model,
                prompt,
                sampling=SamplingParams(**{**sampling.__dict__, "seed": 11 + i}),
                max_tokens=6,
                stats=single,
            )
        )
        assert alt.stats.token_ids == single.token_ids and alt.text == text
        alt.seq.free()


def decoded_alone(model, seqs, tokens):
    """Logits of each sequence's next token decoded on its own; the sequences are left as they were, in
    the same slots (none of the tokens fills a block), so that a step of all of them reads their KV in
    the same pieces: how the history is cut into pieces changes the float32 sums of attention."""
    rows = []
    for seq, t in zip(seqs, tokens, strict=True):
        rows.append(model.forward([t], seq)[0])
        seq.truncate(seq.n_tokens - 1)
    return rows


def test_unrelated_sequences_decoded_together_get_the_bits_each_gets_alone(model):
    """The scheduler decodes every active conversation in one pass: two sequences of different lengths
    (one across gemma3's window of 8) and different tokens, each row as decoding it alone gives."""
    a, b = model.new_sequence(64), model.new_sequence(64)
    model.forward(ids_of(model, 3, seed=1), a)
    model.forward(ids_of(model, 2 * B + 2, seed=2), b)
    for tokens in [(7, 19), (23, 4), (8, 9)]:
        alone = decoded_alone(model, [a, b], tokens)
        together = model.decode_batch(list(tokens), [a, b])
        assert np.array_equal(together[0], alone[0]) and np.array_equal(together[1], alone[1])
    assert a.tokens[3:] == [7, 23, 8] and b.tokens[2 * B + 2 :] == [19, 4, 9]


def test_sequences_decoded_together_by_the_attention_kernel_get_the_bits_each_gets_alone(model, monkeypatch):
    """Where the compiled kernel attends for decoded tokens, a step's rows go to it in one call, every
    sequence's: each row is still what decoding it alone gives, over histories of different lengths."""
    monkeypatch.setattr(forward, "KERNEL_ATTENTION_FROM", 1)
    calls = []
    by_kernel = kernels.tokens_attention
    counted = lambda q, *args: calls.append(len(q)) or by_kernel(q, *args)  # noqa: E731
    monkeypatch.setattr(kernels, "tokens_attention", counted)
    lengths = (3, 2 * B + 2, 200)
    seqs = [model.new_sequence(256) for _ in lengths]
    for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        model.forward(ids_of(model, n, seed=i + 1), seq)
    for tokens in [(7, 19, 5), (23, 4, 11)]:
        alone = decoded_alone(model, seqs, tokens)
        calls.clear()
        together = model.decode_batch(list(tokens), seqs)
        assert all(np.array_equal(t, a) for t, a in zip(together, alone, strict=True))
        # the three rows in one call (gemma2 soft-caps its scores, which the kernel does not: BLAS)
        assert 3 in calls or model.config.attn_logit_softcap


@pytest.mark.parametrize("piece", [5, KERNEL_ROWS + 2], ids=["small step", "large step"])
def test_a_prompt_pass_and_other_replies_tokens_share_one_step(model, piece):
    """One step may hold a pass of one prompt beside the next token of other replies: each sequence
    gets what running it alone gives (the same bits while a step has at most KERNEL_ROWS rows, the
    kernels' promise; a larger step goes to BLAS, equal within float32 rounding)."""
    prompt = ids_of(model, piece, seed=3)
    first, second = model.new_sequence(64), model.new_sequence(64)
    model.forward(ids_of(model, 9, seed=4), first)
    model.forward(ids_of(model, 2 * B + 3, seed=5), second)
    alone_prompt = model.forward(prompt, model.new_sequence(64))[0]
    expected = [alone_prompt, *decoded_alone(model, [first, second], [11, 12])]
    fresh = model.new_sequence(64)
    rows = model.step([(fresh, prompt), (first, [11]), (second, [12])])
    assert fresh.tokens == prompt and first.tokens[-1] == 11 and second.tokens[-1] == 12
    for got, want in zip(rows, expected, strict=True):
        assert got.shape == want.shape == (model.config.n_vocab,)
        if piece + 2 <= KERNEL_ROWS:
            assert np.array_equal(got, want)
        else:
            assert np.abs(got - want).max() <= 1e-4


def test_a_prompt_is_prefilled_one_pass_at_a_time_and_can_stop_between_two(tiny_model_paths):
    model = load_model(tiny_model_paths["qwen2"], block_size=B, prefill_batch=8)
    prompt = ids_of(model, 21)
    seq = model.new_sequence(64)
    passes = model.prefill(prompt, seq)
    assert next(passes)[0] == 8 and seq.n_tokens == 8  # one pass, then it waits
    passes.close()  # stopped: the sequence keeps the pass done
    done = [d for d, _ in model.prefill(prompt[8:], seq)]
    assert done == [8, 13] and seq.tokens == prompt
    whole = load_model(tiny_model_paths["qwen2"], block_size=B)  # one pass of the default 512
    assert np.abs(model.forward([5], seq) - whole.logits(prompt + [5])[-1:]).max() <= 1e-4


class StoredBlocks:
    """A block source holding the full blocks of other sequences (as the conversation store does)."""

    def __init__(self):
        self.blocks: dict = {}
        self.asked = 0

    def keep(self, seq):
        for block in seq.blocks[: seq.n_tokens // seq.pool.block_size]:
            self.blocks[block.key] = (block.tokens, *(a.copy() for a in seq.pool.block_kv(block)))

    def fetch(self, key, tokens, namespace, out):
        self.asked += 1
        found = self.blocks.get(key)
        if found is None or found[0] != tokens:
            return False
        out[0][...], out[1][...] = found[1:]
        return True


def test_a_pool_reads_missing_blocks_from_its_source_and_takes_only_one(tiny_model_paths):
    path = tiny_model_paths["qwen2"]
    source = StoredBlocks()
    first = load_model(path, block_size=B)
    prompt = ids_of(first, 3 * B + 2)
    seq = first.new_sequence(64)
    first.forward(prompt, seq)
    source.keep(seq)
    later = load_model(path, block_size=B, source=source)  # another process, its RAM empty
    resumed = later.new_sequence(64)
    assert resumed.reuse_prefix(prompt) == 3 * B and source.asked == 3
    assert np.abs(later.forward(prompt[3 * B :], resumed) - first.logits(prompt)[-1:]).max() <= 1e-4
    with pytest.raises(RuntimeError, match="already reads from another block source"):
        later.pool.attach_source(StoredBlocks())
    with pytest.raises(AttributeError):
        later.pool.source = StoredBlocks()
    first.pool.attach_source(source)  # a pool built without one takes one, once
    assert first.pool.source is source
