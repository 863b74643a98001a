"""The generation loop: prefill a prompt, then sample and stream text piece by piece until a stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .chat_template import completion_prompt
from .constrain import Constraint
from .kernels import KERNEL_ROWS
from .kv_cache import KVSequence
from .lookup import MAX_DRAFT, PromptLookup
from .model import Model
from .sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from .tool_calls import tool_format


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens of the prompt
    prefilled_tokens: int = 0  # of those, the ones computed now (the rest came from the cache)
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decoded_tokens: int = 0  # tokens decoded after the prefill (each one forward row)
    decode_s: float = 0.0
    drafted_tokens: int = 0  # tokens guessed by prompt lookup and checked by the model
    accepted_tokens: int = 0  # of those, the ones the model produced itself
    stop_reason: str = ""  # "eog", "length", "stop", "cancelled"
    token_ids: list[int] = field(default_factory=list)  # what was generated, end token excluded
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when sampling asks for them

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decoded_tokens / self.decode_s if self.decode_s else 0.0


def prompt_text(
    model: Model, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """Messages rendered with the model's chat template (plain completion text for base models)."""
    if model.has_chat_template:
        fmt = tool_format(model.chat_template) if tools else None
        extra = fmt.template_vars if fmt is not None else {}  # e.g. where Llama 3's template puts the tools
        return model.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    return completion_prompt(messages)


def chat_prompt_ids(
    model: Model,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    limit: int | None = None,
) -> list[int]:
    """Render messages with the model's chat template (plain completion for base models) and tokenize.
    `tools` (OpenAI's function definitions) are rendered by the template, if it takes them. Only the
    template's markup becomes control tokens: every string of the messages and the tools (contents,
    names, descriptions, schemas, call arguments, tool results) is text, so none can forge a turn.
    TooManyTokens for a prompt over `limit` tokens, found out before the whole is tokenized
    (Tokenizer.encode)."""
    tok = model.tokenizer
    shield = tok.control_text_shield([messages, tools])
    text = prompt_text(model, shield.hide(messages), add_generation_prompt, shield.hide(tools))
    bos_text = "" if tok.bos_id is None else tok.token_bytes(tok.bos_id).decode("utf-8", "replace")
    add_bos = tok.add_bos and not (bos_text and text.startswith(bos_text))  # templates often write BOS
    return tok.encode(text, add_bos=add_bos, special=True, shield=shield, limit=limit)


def fit_messages(
    model: Model,
    messages: list[dict],
    budget: int,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns after the system prompt until the prompt fits in `budget` tokens.
    The last message always stays (a prompt longer than the window fails in forward). `tools`: as
    chat_prompt_ids'."""
    messages = list(messages)
    if not messages:
        return [], []
    ids = chat_prompt_ids(model, messages, add_generation_prompt, tools)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]
        # a conversation does not start with the assistant's reply to a dropped question
        while len(messages) - first > 1 and messages[first]["role"] == "assistant":
            del messages[first]
        ids = chat_prompt_ids(model, messages, add_generation_prompt, tools)
    return messages, ids


def shift_to(model: Model, seq: KVSequence, ids: list[int]) -> None:
    """If ids are the sequence's tokens with one stretch cut out (old turns dropped), cut that stretch
    from the KV by context shift rather than recomputing what follows it."""
    keep = seq.common_prefix(ids)
    old = seq.tokens
    if keep >= len(ids):
        return
    for j in range(keep + 1, len(old)):  # where the kept stretch of the old tokens starts again
        if old[j] == ids[keep] and old[j:] == ids[keep : keep + len(old) - j]:
            model.context_shift(seq, keep, j - keep)
            return


class _StopStrings:
    """Holds back text that may be the start of a stop string, so a stop string is never shown."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Reply:
    """One reply being generated: samples each token, decodes it, watches for every kind of stop."""

    def __init__(
        self, model: Model, prompt_ids: list[int], sampling: SamplingParams, stop, max_tokens, stats,
        continues_text: bool = False,
    ):  # fmt: skip
        self.end_ids = model.tokenizer.end_of_generation_ids
        self.sampler = Sampler(sampling)
        self.n_logprobs = sampling.logprobs
        self.constraint = Constraint(model.tokenizer, sampling.grammar) if sampling.grammar else None
        self.decoder = model.tokenizer.stream_decoder(starts_text=not continues_text)
        self.stops = _StopStrings(stop)
        self.history = list(prompt_ids)  # what the repetition penalty looks back over
        self.max_tokens = max_tokens
        self.stats = stats
        self.pieces: list[str] = []

    def take(self, logits) -> tuple[str, bool]:
        """Sample the next token from logits; return its text and whether the reply goes on."""
        stats = self.stats
        if stats.generated_tokens >= self.max_tokens:
            stats.stop_reason = "length"
            return "", False
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = self.sampler.sample(logits, self.history)
        if self.constraint is not None and not self.constraint.accept(token):
            stats.stop_reason = "eog"  # the grammar allows nothing more (it only fails on a broken grammar)
            return "", False
        if token in self.end_ids:
            stats.stop_reason = "eog"
            return "", False
        stats.generated_tokens += 1
        stats.token_ids.append(token)
        if self.n_logprobs is not None:
            stats.logprobs.append(token_logprob(logits, token, self.n_logprobs))
        self.history.append(token)
        text, stopped = self.stops.push(self.decoder.feed(token))
        self.pieces.append(text)
        if stopped:
            stats.stop_reason = "stop"
            return text, False
        if stats.generated_tokens >= self.max_tokens:
            stats.stop_reason = "length"
            return text, False
        return text, True

    def finish(self) -> str:
        rest = (
            ""
            if self.stats.stop_reason == "stop"
            else self.stops.push(self.decoder.flush())[0] + self.stops.flush()
        )
        self.pieces.append(rest)
        return rest

    @property
    def last_token(self) -> int:
        return self.stats.token_ids[-1]


Progress = Callable[[int, int], None]


def _prefill(
    model: Model,
    prompt_ids: list[int],
    seq: KVSequence,
    stats: GenerationStats,
    on_prefill: Progress | None = None,
    cancel: threading.Event | None = None,
) -> np.ndarray | None:
    """Prefill what the sequence does not hold yet; the last prompt token always runs, for its logits.
    A long prompt goes one forward pass at a time (Model.prefill): on_prefill(done, total) hears of each,
    and a cancel stops it between two (None then; the sequence keeps the passes done, for the next turn)."""
    seq.reuse_prefix(prompt_ids[:-1])
    stats.prompt_tokens = len(prompt_ids)
    todo = prompt_ids[seq.n_tokens :]
    logits = None
    t0 = time.perf_counter()
    for done, row in model.prefill(todo, seq):
        stats.prefilled_tokens, logits = done, row
        if on_prefill is not None and len(todo) > model.prefill_batch:
            on_prefill(done, len(todo))
        if done < len(todo) and cancel is not None and cancel.is_set():
            break
    stats.prefill_s = time.perf_counter() - t0
    return logits if stats.prefilled_tokens == len(todo) else None


def generate(
    model: Model,
    prompt_ids: Sequence[int],
    *,
    seq: KVSequence | None = None,
    sampling: SamplingParams | None = None,
    max_tokens: int = 512,
    stop: Sequence[str] = (),
    cancel: threading.Event | None = None,
    stats: GenerationStats | None = None,
    on_prefill: Progress | None = None,
    lookup: bool | None = None,
) -> Iterator[str]:
    """Yield the reply as text pieces (never half a UTF-8 character).

    `seq` may hold an earlier turn: the longest common prefix is kept, full blocks other sequences
    already computed are shared, and only the rest is prefilled. Without `seq` a temporary one is used.
    Setting `cancel` stops the loop before the next token. `stats` is filled in as it goes;
    on_prefill(done, total) hears how a long prompt's prefill advances. `lookup` guesses runs of tokens
    from the conversation (prompt lookup) and lets the model check them in one pass; the reply is the
    same token for token, seeded sampling included (None: as the model was loaded, on by default).
    """
    stats = stats if stats is not None else GenerationStats()
    prompt_ids = list(prompt_ids)
    own_seq = seq is None
    if own_seq:
        seq = model.new_sequence(len(prompt_ids) + max_tokens + 1)
    try:
        logits = _prefill(model, prompt_ids, seq, stats, on_prefill, cancel)
        lookup = model.prompt_lookup if lookup is None else lookup
        (stream,) = start_streams(
            model,
            prompt_ids,
            seq,
            logits,
            [stats],
            sampling=sampling or SamplingParams(),
            stop=stop,
            max_tokens=max_tokens,
            lookup=lookup,
        )
        yield from _decode(model, stream, cancel)
    finally:
        if own_seq:
            seq.free()


class ReplyStream:
    """One reply decoding, a forward pass at a time, alone or in a batch with others (run_streams).

    Each pass computes the row of the token just sampled and, with prompt lookup, of a guessed run
    after it (`queued`: KV written but not yet taken). While the sampled tokens follow the guess, their
    rows are already there; where they part, the rest of the guess is dropped. Every row is computed as
    decoding its token alone would compute it, so the text never depends on the guess or the batch."""

    def __init__(self, model: Model, seq: KVSequence, reply: _Reply, logits, lookup: PromptLookup | None):
        self.model = model
        self.seq = seq
        self.reply = reply
        self.stats = reply.stats
        self.lookup = lookup
        self.rows = [logits]  # logits computed and not sampled yet: rows[0] is for the next token
        self.queued: list[int] = []
        self.drafted = 0
        self.pending: list[int] = []  # tokens for the next forward pass: the sampled one, then a guess
        self.done = False
        self.t0 = time.perf_counter()

    def advance(self, cancel: threading.Event | None, draft_room: int = MAX_DRAFT) -> list[str]:
        """Sample every token whose row is ready; return their text. Then the stream is done, or
        `pending` holds the tokens its next pass needs (at most draft_room guessed ones)."""
        stats, reply, seq = self.stats, self.reply, self.seq
        out: list[str] = []
        while True:
            if cancel is not None and cancel.is_set():
                stats.stop_reason = "cancelled"
                return self._finish(out)
            text, going = reply.take(self.rows.pop(0))
            if text:
                out.append(text)
            if not going:
                return self._finish(out)
            token = reply.last_token
            if self.lookup is not None:
                self.lookup.push(token)
            stats.decoded_tokens += 1
            if self.queued and self.queued[0] == token:  # the guess held: this token's KV and row are ready
                seq.commit([self.queued.pop(0)])
                stats.accepted_tokens += 1
                continue
            if self.lookup is not None:
                self.lookup.taken(self.drafted, self.drafted - len(self.queued))
            seq.truncate(seq.n_tokens)  # the KV of a guess that broke off is given back
            room = (
                min(seq.n_ctx - seq.n_tokens, reply.max_tokens - stats.generated_tokens, draft_room + 1) - 1
            )
            self.queued = self.lookup.propose()[: max(room, 0)] if self.lookup is not None else []
            self.drafted = len(self.queued)
            stats.drafted_tokens += self.drafted
            self.pending = [token, *self.queued]
            return out

    def computed(self, rows) -> None:
        """The logits of `pending` arrived: the sampled token is taken, the guess waits to be checked."""
        self.rows = list(rows)
        self.seq.commit(self.pending[:1])
        self.pending = []
        self.stats.decode_s = time.perf_counter() - self.t0

    def _finish(self, out: list[str]) -> list[str]:
        self.done = True
        self.seq.truncate(self.seq.n_tokens)
        self.stats.decode_s = time.perf_counter() - self.t0
        rest = self.reply.finish()
        return [*out, rest] if rest else out


def run_streams(model: Model, streams: Sequence[ReplyStream]) -> None:
    """One forward pass for every stream that waits for one: weights read once for all of them."""
    waiting = [s for s in streams if s.pending]
    for s, rows in zip(waiting, model.verify_rows([(s.seq, s.pending) for s in waiting]), strict=True):
        s.computed(rows)


def draft_rooms(n_streams: int) -> int:
    """Guessed tokens each stream may add to a pass of n streams: a pass of the kernels reads each
    weight once for all its rows (up to KERNEL_ROWS), so guesses fill what the streams leave of it."""
    return max(0, (KERNEL_ROWS - n_streams) // max(n_streams, 1))


def start_streams(
    model: Model,
    prompt_ids: list[int],
    seq: KVSequence,
    logits,
    stats: list[GenerationStats],
    *,
    sampling: SamplingParams,
    stop: Sequence[str],
    max_tokens: int,
    lookup: bool,
    continues_text: bool = False,
) -> list[ReplyStream]:
    """The replies to a prompt prefilled in `seq` (logits: its last row; None when the prefill was
    cancelled: the streams stop before reading it): one in `seq` itself, or one per stats in forks of it,
    each sharing the prompt's blocks. Reply i samples with seed + i: reproducible, and they differ.
    `continues_text`: the prompt is text the replies go on from, not a turn they answer: their first
    token keeps the leading space a SentencePiece vocabulary's first token drops from a text."""
    n = len(stats)
    seqs = [seq] if n == 1 else [seq.fork() for _ in range(n)]
    limit = min(max_tokens, seq.n_ctx - len(prompt_ids))
    streams = []
    for i, (s, st) in enumerate(zip(seqs, stats, strict=True)):
        st.prompt_tokens, st.prefilled_tokens, st.prefill_s = (
            stats[0].prompt_tokens,
            stats[0].prefilled_tokens,
            stats[0].prefill_s,
        )
        params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
        reply = _Reply(model, prompt_ids, params, stop, limit, st, continues_text)
        streams.append(ReplyStream(model, s, reply, logits, PromptLookup(prompt_ids) if lookup else None))
    return streams


def _decode(model: Model, stream: ReplyStream, cancel: threading.Event | None) -> Iterator[str]:
    try:
        while True:
            yield from stream.advance(cancel)
            if stream.done:
                return
            run_streams(model, [stream])
    finally:
        stream.seq.truncate(stream.seq.n_tokens)


@dataclass
class Alternative:
    text: str
    stats: GenerationStats
    seq: KVSequence  # the prompt and this reply's KV: keep it to continue this branch, or free() it


def generate_alternatives(
    model: Model,
    prompt_ids: Sequence[int],
    n: int,
    *,
    seq: KVSequence | None = None,
    sampling: SamplingParams | None = None,
    max_tokens: int = 512,
    stop: Sequence[str] = (),
    cancel: threading.Event | None = None,
    on_prefill: Progress | None = None,
) -> list[Alternative]:
    """n replies to one prompt, decoded together: the prompt is prefilled once, then each step runs
    one token of every unfinished reply in a single forward pass ("regenerate ×n").

    With a seed, reply i uses seed + i, so the set is reproducible and the replies differ."""
    sampling = sampling or SamplingParams()
    prompt_ids = list(prompt_ids)
    base = seq if seq is not None else model.new_sequence(len(prompt_ids) + max_tokens + 1)
    first = GenerationStats()
    logits = _prefill(model, prompt_ids, base, first, on_prefill, cancel)
    stats = [first] + [GenerationStats() for _ in range(n - 1)]
    streams = start_streams(
        model,
        prompt_ids,
        base,
        logits,
        stats,
        sampling=sampling,
        stop=stop,
        max_tokens=max_tokens,
        lookup=False,
    )
    if seq is None and n > 1:
        base.free()
    texts: list[list[str]] = [[] for _ in streams]
    while not all(s.done for s in streams):
        for s, text in zip(streams, texts, strict=True):
            if not s.done:
                text += s.advance(cancel)
        run_streams(model, streams)
    return [Alternative("".join(t), s.stats, s.seq) for s, t in zip(streams, texts, strict=True)]
