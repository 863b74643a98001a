"""OpenAI's Chat Completions as this server writes them: the shapes of replies, chunks and usage
that clients expect, and where a reply was stored."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from llama_chat.inference import GenerationStats
from llama_chat.inference.sampling import TokenLogprob
from llama_chat.inference.tool_calls import ToolCall
from llama_chat.storage import StoreError


@dataclass
class Kept:
    """Where a reply was stored: its session (None: nowhere), and why not where it was to be (a full
    disk: then the client holds the only copy)."""

    session: str | None = None
    error: StoreError | None = None

    def fields(self) -> dict:
        """What a completion, its last chunks and its usage chunk say of it."""
        out = {"session": self.session, "stored": self.session is not None}
        if self.error is not None:
            out["store_error"] = f"The reply was not stored: {self.error.brief or 'see the server log'}."
        return out

    @property
    def error_code(self) -> str | None:
        """The X-Store-Error header of a reply not stored where it was to be."""
        if self.error is None:
            return None
        return "disk_full" if self.error.full else "storage_error"


@dataclass
class Reply:
    """What every message of one completion shares."""

    model: str
    system_fingerprint: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, object_type: str) -> dict:
        return {
            "id": self.id,
            "object": object_type,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def completion(
        self,
        texts: list[str],
        stats: list[GenerationStats],
        kept: Kept,
        kv_remote: dict | None = None,
        calls: list[list[ToolCall]] | None = None,
        logprobs: list[list[dict]] | None = None,
        thinking: list[str] | None = None,
    ) -> dict:
        """The reply; `calls`: each alternative's tool calls (its text then is the content before them);
        `thinking`: each one's thinking, given as llama.cpp's server gives it (reasoning_content)."""
        calls = calls or [[] for _ in texts]
        choices = []
        for i, (text, s, made) in enumerate(zip(texts, stats, calls, strict=True)):
            message = {"role": "assistant", "content": text or (None if made else ""), "refusal": None}
            if thinking and thinking[i]:
                message["reasoning_content"] = thinking[i]
            if made:
                message["tool_calls"] = [tool_call(c) for c in made]
            content = None if logprobs is None else {"content": logprobs[i], "refusal": None}
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": content,
                    "finish_reason": finish_reason(s, bool(made)),
                }
            )
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "usage": usage(stats, kv_remote),
            **kept.fields(),
        }

    def chunk(
        self, index: int, delta: dict, finish: str | None = None, logprobs: list[dict] | None = None, **extra
    ) -> dict:
        content = None if logprobs is None else {"content": logprobs, "refusal": None}
        choice = {"index": index, "delta": delta, "logprobs": content, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None, **extra}

    def usage_chunk(self, stats: list[GenerationStats], kept: Kept, kv_remote: dict | None = None) -> dict:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [],
            "usage": usage(stats, kv_remote),
            **kept.fields(),
        }


def finish_reason(stats: GenerationStats, called: bool = False) -> str:
    """OpenAI's names: "length" when the token limit (or the context window) ended it, "tool_calls"
    when it ended with tool calls, else "stop"."""
    if stats.stop_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def tool_call(call: ToolCall) -> dict:
    """A call as OpenAI writes it: its id, the function's name and its arguments as JSON text."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def token_logprobs(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """Tokens' log-probabilities as OpenAI writes them: each token's text and UTF-8 bytes."""

    def one(token: int, logprob: float) -> dict:
        data = tokenizer.token_bytes(token)
        return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def usage(stats: list[GenerationStats], kv_remote: dict | None = None) -> dict:
    """Tokens of the prompt (counted once for n alternatives), of the replies, and how many of the
    prompt's came from the KV cache (RAM, the database or the remote tier) rather than being computed;
    with a remote tier, its numbers as `kv_remote` (clients ignore a field they do not know)."""
    prompt = stats[0].prompt_tokens
    completion = sum(s.generated_tokens for s in stats)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": prompt - stats[0].prefilled_tokens},
    }
    if kv_remote is not None:
        out["kv_remote"] = kv_remote
    return out
