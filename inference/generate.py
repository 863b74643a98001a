"""The generation loop: prefill a prompt, then sample and stream text piece by piece until a stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .chat_template import completion_prompt
from .kv_cache import KVCache
from .llm import Model
from .sampling import Sampler, SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens of the prompt
    prefilled_tokens: int = 0  # of those, the ones computed now (the rest came from the cache)
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decoded_tokens: int = 0  # one-token forward passes run while generating
    decode_s: float = 0.0
    stop_reason: str = ""  # "eog", "length", "stop", "cancelled"
    token_ids: list[int] = field(default_factory=list)  # what was generated, end token excluded

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decoded_tokens / self.decode_s if self.decode_s else 0.0


def chat_prompt_ids(model: Model, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Render messages with the model's chat template (plain completion for base models) and tokenize."""
    tok = model.tokenizer
    if model.has_chat_template:
        text = model.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
    else:
        text = completion_prompt(messages)
    bos_text = "" if tok.bos_id is None else tok.token_bytes(tok.bos_id).decode("utf-8", "replace")
    add_bos = tok.add_bos and not (bos_text and text.startswith(bos_text))  # templates often write BOS
    return tok.encode(text, add_bos=add_bos, special=True)


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


def generate(
    model: Model,
    prompt_ids: Sequence[int],
    *,
    cache: KVCache | None = None,
    sampling: SamplingParams | None = None,
    max_tokens: int = 512,
    stop: Sequence[str] = (),
    cancel: threading.Event | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[str]:
    """Yield the reply as text pieces (never half a UTF-8 character).

    `cache` may hold an earlier turn: the longest common prefix is kept and only the rest is prefilled.
    Setting `cancel` stops the loop before the next token. `stats` is filled in as it goes.
    """
    stats = stats if stats is not None else GenerationStats()
    sampler = Sampler(sampling or SamplingParams())
    tok = model.tokenizer
    if cache is None:
        cache = model.new_cache(min(model.config.n_ctx_train, len(prompt_ids) + max_tokens + 1))
    # Reuse the longest prefix the cache already holds; at least one token must run to give logits.
    cache.truncate(min(cache.common_prefix(prompt_ids), len(prompt_ids) - 1))
    stats.prompt_tokens = len(prompt_ids)
    stats.prefilled_tokens = len(prompt_ids) - cache.n_tokens
    max_tokens = min(max_tokens, cache.n_ctx - len(prompt_ids))
    history = list(prompt_ids)
    decoder = tok.stream_decoder()
    stops = _StopStrings(stop)

    t0 = time.perf_counter()
    logits = model.forward(prompt_ids[cache.n_tokens :], cache)[-1]
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats.stop_reason = "length"
    while stats.generated_tokens < max_tokens:
        if cancel is not None and cancel.is_set():
            stats.stop_reason = "cancelled"
            break
        token = sampler.sample(logits, history)
        if token in tok.end_of_generation_ids:
            stats.stop_reason = "eog"
            break
        stats.generated_tokens += 1
        stats.token_ids.append(token)
        history.append(token)
        text, stopped = stops.push(decoder.feed(token))
        if text:
            yield text
        if stopped:
            stats.stop_reason = "stop"
            break
        if stats.generated_tokens < max_tokens and cache.n_tokens < cache.n_ctx:
            logits = model.forward([token], cache)[-1]
            stats.decoded_tokens += 1
        stats.decode_s = time.perf_counter() - t0
    if stats.stop_reason != "stop":
        rest = stops.push(decoder.flush())[0] + stops.flush()
        if rest:
            yield rest
