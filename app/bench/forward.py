"""Measurements of the forward pass on a loaded model: prefill, decode, prompt lookup, a JSON mask,
prefix reuse, fork, batched and concurrent replies, the tokenizer.

Each returns a figure meant to be read as a ratio against a baseline taken in the same run.
"""

from __future__ import annotations

import time

import numpy as np

from .samples import CODE_EDIT, PET_SCHEMA, sample_text, sample_tokens


def measure_lookup(model, max_tokens: int) -> dict:
    """Greedy decode of a reply that edits code from the prompt, with and without prompt lookup."""
    from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, generate

    ids = chat_prompt_ids(model, CODE_EDIT)
    runs = {}
    for lookup in (False, True):
        stats = GenerationStats()
        greedy = SamplingParams(temperature=0)
        text = "".join(
            generate(model, ids, sampling=greedy, max_tokens=max_tokens, stats=stats, lookup=lookup)
        )
        runs[lookup] = (text, stats)
    (plain, plain_stats), (looked, stats) = runs[False], runs[True]
    return {
        "plain_tok_s": plain_stats.decode_tok_s,
        "lookup_tok_s": stats.decode_tok_s,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "same_text": looked == plain,
        "same_tokens": stats.token_ids == plain_stats.token_ids,
        "token_ids": stats.token_ids,
    }


def measure_json_mask(model, max_tokens: int) -> dict:
    """A greedy reply under a JSON schema (nested object, enum, array): its decode time per token, and
    the grammar's share of it (its mask and step per token, replayed alone over the same tokens)."""
    from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, generate
    from llama_chat.inference.constrain import Constraint, check_grammar, json_schema_grammar

    grammar = check_grammar(model.tokenizer, json_schema_grammar(PET_SCHEMA))  # the vocabulary read once
    ids = chat_prompt_ids(model, [{"role": "user", "content": "Invent a pet and its owner, as JSON."}])
    stats = GenerationStats()
    sampling = SamplingParams(temperature=0, grammar=grammar)
    "".join(generate(model, ids, sampling=sampling, max_tokens=max_tokens, stats=stats, lookup=False))
    constraint, logits = Constraint(model.tokenizer, grammar), np.zeros(model.config.n_vocab, np.float32)
    t = time.perf_counter()
    for token in stats.token_ids:
        constraint.mask(logits)
        constraint.accept(token)
    mask_ms = 1000 * (time.perf_counter() - t) / max(len(stats.token_ids), 1)
    decode_ms = 1000 / stats.decode_tok_s if stats.decode_tok_s else 0.0
    return {"mask_ms": mask_ms, "decode_ms": decode_ms, "tokens": len(stats.token_ids)}


def measure_prefill(model, n: int, repeats: int) -> float:
    ids = sample_tokens(model.tokenizer, n)
    best = float("inf")
    for _ in range(repeats):
        seq = model.new_sequence(n + 1)
        t = time.perf_counter()
        model.forward(ids, seq)  # forward never looks for shared blocks: every token is computed
        best = min(best, time.perf_counter() - t)
        seq.free()
    return n / best


def measure_short_prefill(model, cached: int, n: int, repeats: int) -> float:
    """Milliseconds to read a new turn of n tokens after `cached` tokens already in the cache (the time
    to first token of a continued chat), the best of `repeats`, each on a fork of the cached sequence."""
    ids = sample_tokens(model.tokenizer, cached + n)
    seq = model.new_sequence(cached + n + 1)
    model.forward(ids[:cached], seq)
    best = float("inf")
    for _ in range(repeats):
        turn = seq.fork()
        t = time.perf_counter()
        model.forward(ids[cached:], turn)
        best = min(best, time.perf_counter() - t)
        turn.free()
    seq.free()
    return best * 1000


def measure_decode_contexts(model, contexts: tuple[int, ...], n_tokens: int) -> list[float]:
    """Decode tokens/s at several context lengths, one token of each in turn, so that a busy moment
    of this shared machine slows every context alike and their ratio stays meaningful."""
    ids = sample_tokens(model.tokenizer, max(contexts))
    seqs, logits = [], []
    for n in contexts:
        seqs.append(model.new_sequence(n + n_tokens + 1))
        logits.append(model.forward(ids[:n], seqs[-1])[-1])
    elapsed = [0.0] * len(contexts)
    for _ in range(n_tokens):
        for i, seq in enumerate(seqs):
            t = time.perf_counter()
            logits[i] = model.forward([int(np.argmax(logits[i]))], seq)[-1]
            elapsed[i] += time.perf_counter() - t
    for seq in seqs:
        seq.free()
    return [n_tokens / e for e in elapsed]


def measure_prefix_reuse(model, shared: int, extra: int) -> dict:
    """A second conversation whose first `shared` tokens equal an earlier one's prefills only the rest."""
    ids = sample_tokens(model.tokenizer, shared + extra)
    first = model.new_sequence(shared + extra + 1)
    model.forward(ids[:shared], first)
    second = model.new_sequence(shared + extra + 1)
    other = ids[:shared] + sample_tokens(model.tokenizer, extra + 7)[7:]  # same start, different end
    t = time.perf_counter()
    saved = second.reuse_prefix(other)
    model.forward(other[saved:], second)
    reuse_s = time.perf_counter() - t
    third = model.new_sequence(shared + extra + 1)
    t = time.perf_counter()
    model.forward(other, third)
    full_s = time.perf_counter() - t
    for seq in (first, second, third):
        seq.free()
    return {"saved_tokens": saved, "reuse_ms": reuse_s * 1000, "full_ms": full_s * 1000}


def measure_fork(model, n: int) -> dict:
    seq = model.new_sequence(n + 1)
    model.forward(sample_tokens(model.tokenizer, n), seq)
    before = model.pool.memory_breakdown()["in_use_bytes"]
    t = time.perf_counter()
    child = seq.fork()
    fork_ms = (time.perf_counter() - t) * 1000
    added = model.pool.memory_breakdown()["in_use_bytes"] - before
    child.free()
    seq.free()
    return {"fork_ms": fork_ms, "added_bytes": added}


def measure_batch3(model, context: int, n_tokens: int) -> float:
    """Time of 3 alternatives decoded together over the time of one, after a shared prompt."""
    seq = model.new_sequence(context + n_tokens + 1)
    model.forward(sample_tokens(model.tokenizer, context), seq)
    one = seq.fork()
    t = time.perf_counter()
    for _ in range(n_tokens):
        model.decode_batch([42], [one])
    single = time.perf_counter() - t
    three = [seq.fork() for _ in range(3)]
    t = time.perf_counter()
    for _ in range(n_tokens):
        model.decode_batch([42, 43, 44], three)
    batch = time.perf_counter() - t
    for s in [seq, one, *three]:
        s.free()
    return batch / single


def measure_jobs_at_once(
    model, context: int, n_tokens: int, counts: tuple[int, ...] = (2, 8)
) -> dict[int, float]:
    """C conversations replying at once through the scheduler (one batch per step) against one alone, for
    each C of counts: decode time per token of the slowest of the C over that of the one. Each
    conversation is a shared prompt read before the clock starts and a token of its own."""
    from ..chat.jobs import Job
    from ..chat.scheduler import Scheduler

    scheduler = Scheduler(model, parallel=max(counts))
    ids = sample_tokens(model.tokenizer, context)
    base = model.new_sequence(context + n_tokens + 2)
    model.forward(ids[:-1], base)
    vocab = sorted(set(ids))

    def job(i: int) -> Job:
        prompt = [*ids, vocab[i % len(vocab)]]  # its own last token: a reply of its own
        return Job(
            lambda: (prompt, base.fork()),
            max_tokens=n_tokens,
            lookup=False,  # the same work per token for every reply
            finish=lambda job: [s.free() for s in job.seqs],
        )

    def per_token(jobs: list[Job]) -> float:
        for j in jobs:
            scheduler.submit(j)
        for j in jobs:
            j.wait()
        return max(j.stats[0].decode_s / max(j.stats[0].generated_tokens, 1) for j in jobs)

    one = per_token([job(0)])
    ratios = {c: per_token([job(1 + i) for i in range(c)]) / one for c in counts}
    scheduler.close()
    base.free()
    return ratios


def measure_tokenizer(tokenizer, n_tokens: int) -> tuple[int, float]:
    text = sample_text()[: n_tokens * 4]
    t = time.perf_counter()
    ids = tokenizer.encode(text)
    return len(ids), time.perf_counter() - t
