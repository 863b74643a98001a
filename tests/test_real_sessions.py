"""On the default model: a session resumed from SQLite with the default codec replies as the live one."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import real_cache
from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import stream_text
from llama_chat.app.chat.settings import CODEC
from llama_chat.inference import GenerationStats, Model, SamplingParams, chat_prompt_ids
from llama_chat.inference.weights import prepare
from llama_chat.storage import ChatStore

pytestmark = pytest.mark.real_model

CONVERSATIONS = [
    (
        "You are a concise coding assistant.",
        ["Write a Python function that reverses a string.", "Now add type hints."],
    ),
    (None, ["What is a KV cache in a transformer?", "Why does it make decoding faster?"]),
    ("Answer in one sentence.", ["Name three sorting algorithms.", "Which of them is stable?"]),
]


def fresh_model(path) -> Model:
    """A new model object, with its own empty block pool: what a new process has."""
    with real_cache():
        return Model(prepare(path))


@pytest.fixture
def closing():
    """Engines a test opens, closed after it: each holds its model and KV pool (~1 GB) until then, and
    the real-model tests run one after another on one worker."""
    engines = []
    yield engines.append
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("system, turns", CONVERSATIONS)
def test_resumed_session_replies_exactly_as_the_live_one(qwen_model_path, tmp_path, system, turns, closing):
    greedy = SamplingParams(temperature=0)
    db = tmp_path / "chat.db"
    live = ChatEngine(fresh_model(qwen_model_path), ChatStore(db), codec=CODEC)
    closing(live)
    session = live.new_session("t", system_prompt=system)
    "".join(stream_text(live.reply(session, turns[0], sampling=greedy, max_tokens=48)))
    session = live._store.get_session(session.id)

    resumed = ChatEngine(fresh_model(qwen_model_path), ChatStore(db), codec=CODEC)
    closing(resumed)
    info = resumed.resume(session)
    assert info.restored == info.tokens  # all of it from the store, nothing recomputed

    live_stats, resumed_stats = GenerationStats(), GenerationStats()
    live_reply = "".join(
        stream_text(
            live.reply(live.fork(session), turns[1], sampling=greedy, max_tokens=48, stats=live_stats)
        )
    )
    resumed_reply = "".join(
        stream_text(
            resumed.reply(
                resumed.fork(session), turns[1], sampling=greedy, max_tokens=48, stats=resumed_stats
            )
        )
    )
    assert resumed_stats.prefilled_tokens == resumed_stats.prompt_tokens - info.tokens
    if resumed_stats.token_ids != live_stats.token_ids:
        # Lossy KV may only flip a genuine near-tie: somewhere up to the first difference, the live
        # run's best two tokens must be within 0.1 (a float-noise tie, as between llama.cpp builds).
        first = next(
            i for i, (a, b) in enumerate(zip(live_stats.token_ids, resumed_stats.token_ids)) if a != b
        )
        stored = live._cache.messages(live._store.get_session(session.id))
        prompt = chat_prompt_ids(live._model, [*stored, {"role": "user", "content": turns[1]}])
        logits = live._model.logits(prompt + live_stats.token_ids)[len(prompt) - 1 :]
        margins = [float(np.diff(np.sort(row)[-2:])[0]) for row in logits[: first + 1]]
        assert min(margins) < 0.1, f"diverged at {first} with no near-tie before it: {margins}"
    else:
        assert resumed_reply == live_reply
