"""A conversation as the prompt a model reads: rendered with its chat template, tokenized, fitted to
the context window (the oldest turns dropped, the cached KV following by context shift)."""

from __future__ import annotations

from dataclasses import dataclass

from .chat_template import completion_prompt
from .control_text import ControlTextShield
from .kv_cache import KVSequence
from .model import Model
from .tool_calls import tool_format


def prompt_text(
    model: Model,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    variables: dict | None = None,
) -> str:
    """Messages rendered with the model's chat template (plain completion text for base models);
    `variables` set the template's own switches (enable_thinking, reasoning_effort)."""
    if model.has_chat_template:
        fmt = tool_format(model.chat_template) if tools else None
        extra = fmt.template_vars if fmt is not None else {}  # e.g. where Llama 3's template puts the tools
        return model.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**extra, **(variables or {})},
        )
    return completion_prompt(messages)


def _written_whole(messages: list[dict]) -> list[str]:
    """The texts every chat template writes as they are: each message's but a reply's (a template may
    shorten those: Qwen3's drops the thinking of earlier replies)."""
    texts = [m.get("content") for m in messages if m.get("role") != "assistant"]
    return [text for text in texts if isinstance(text, str)]


def chat_prompt_ids(
    model: Model,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    limit: int | None = None,
    variables: dict | None = None,
) -> list[int]:
    """Render messages with the model's chat template (plain completion for base models) and tokenize.
    `tools` (OpenAI's function definitions) are rendered by the template, if it takes them; `variables`
    as prompt_text's. Only the template's markup becomes control tokens: every string of the messages
    and the tools (contents, names, descriptions, schemas, call arguments, tool results) is text, so
    none can forge a turn. TooManyTokens for a prompt over `limit` tokens, found out before the whole
    is tokenized (Tokenizer.encode) — a text the template surely writes that is too long alone before
    the shield looks through every string."""
    model.tokenizer.check_length(_written_whole(messages), limit)
    return prompt_ids(model, render(model, messages, add_generation_prompt, tools, variables), limit)


@dataclass(frozen=True)
class Rendered:
    """A conversation as its chat template writes it, to be tokenized: the text, with the control text
    of every string from outside hidden by `shield`, and whether BOS goes before it."""

    text: str
    shield: ControlTextShield
    add_bos: bool


def render(
    model: Model,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    variables: dict | None = None,
) -> Rendered:
    """The messages and tools rendered as chat_prompt_ids renders them, before they are tokenized."""
    tok = model.tokenizer
    shield = tok.control_text_shield([messages, tools])
    text = prompt_text(model, shield.hide(messages), add_generation_prompt, shield.hide(tools), variables)
    bos_text = "" if tok.bos_id is None else tok.token_bytes(tok.bos_id).decode("utf-8", "replace")
    add_bos = tok.add_bos and not (bos_text and text.startswith(bos_text))  # templates often write BOS
    return Rendered(text, shield, add_bos)


def prompt_ids(model: Model, rendered: Rendered, limit: int | None = None) -> list[int]:
    """A rendered conversation's tokens: the template's markup as control tokens, the rest as text."""
    text, shield = rendered.text, rendered.shield
    return model.tokenizer.encode(text, add_bos=rendered.add_bos, special=True, shield=shield, limit=limit)


def fit_messages(
    model: Model,
    messages: list[dict],
    budget: int,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    variables: dict | None = None,
    whole: list[int] | None = None,
) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns after the system prompt until the prompt fits in `budget` tokens.
    The last message always stays (a prompt longer than the window fails in forward). `tools` and
    `variables`: as chat_prompt_ids'; `whole`: the tokens of all the messages, where they are made."""
    messages = list(messages)
    if not messages:
        return [], []
    ids = whole
    if ids is None:
        ids = chat_prompt_ids(model, messages, add_generation_prompt, tools, variables=variables)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]
        # a conversation does not start with the assistant's reply to a dropped question
        while len(messages) - first > 1 and messages[first]["role"] == "assistant":
            del messages[first]
        ids = chat_prompt_ids(model, messages, add_generation_prompt, tools, variables=variables)
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
