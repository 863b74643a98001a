"""The remote KV tier against peers that only pass for Redis (a fake server on 127.0.0.1, no redis-server
needed): whatever they answer, replies are computed as without the tier, the tier says it is down and
why, its writer thread goes on, and a trickled answer is cut off after the tier's timeout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import stream_text
from llama_chat.inference import SamplingParams, load_model
from llama_chat.storage import ChatStore, remote_wire
from llama_chat.storage.codec import checksum, encode_kv
from llama_chat.storage.records import StoredBlock
from llama_chat.storage.remote import RemoteTier
from redis_servers import MisbehavingRedis, end_backoff
from served import Served

SECRET = "a secret the servers share"
HISTORY = "hello the world, then the sun and the rain over the hills " * 3
GREEDY = SamplingParams(temperature=0)
TRICKLED = 100  # bytes of the trickled answer, one each 0.2 s: 21 s to send it all

# what redis-py makes of each misbehaviour, as the tier reports it
FAILURE = {
    "hello +OK": "AttributeError",
    "nested reply": "RecursionError",
    "trickle": "TimeoutError",
    "close mid-reply": "ConnectionError",
    "garbage": "InvalidResponse",
    "endless value": "ConnectionError",
}


@pytest.fixture(params=MisbehavingRedis.MISBEHAVIOURS)
def peer(request):
    peer = MisbehavingRedis(request.param, trickle_s=0.2, trickle_bytes=TRICKLED)
    yield peer
    peer.close()


def engine(model_path, db, url: str | None) -> ChatEngine:
    """A fresh process's engine on its own SQLite file, with the remote tier at `url` (None: none)."""
    model = load_model(model_path, block_size=8)
    remote = RemoteTier.from_url(url, SECRET, model.fingerprint) if url else None
    return ChatEngine(model, ChatStore(db), codec="f32", remote=remote)


def reply(engine: ChatEngine, text: str) -> str:
    session = engine.new_session("peer", system_prompt="the sun")
    return "".join(stream_text(engine.reply(session, text, sampling=GREEDY, max_tokens=8)))


def a_block() -> StoredBlock:
    k = np.random.default_rng(0).standard_normal((2, 2, 8, 16)).astype(np.float32)
    data = encode_kv(k, -k, "f32")
    return StoredBlock(b"\1" * 16, 8, "f32", data, checksum(data), list(range(8)))


def test_a_peer_that_misbehaves_is_a_failed_tier_and_the_reply_is_computed(
    qwen2, tmp_path, peer, monkeypatch
):
    # An answer's cap, lowered from 512 MiB so that the endless value is cut off after a few MiB here
    monkeypatch.setattr(remote_wire, "MAX_ANSWER_BYTES", 4 << 20)
    alone = reply(engine(qwen2, tmp_path / "alone.db", None), HISTORY)
    served = engine(qwen2, tmp_path / "a.db", peer.url)
    tier = served._cache.remote

    assert reply(served, HISTORY) == alone  # its blocks were looked for there, then computed
    assert tier.flush()  # and written there: the writer meets the peer on its own (each side backs off)
    end_backoff(tier)  # a read once more, the writer idle: the last error is a read's
    assert tier.fetch_run([(b"\1" * 16, tuple(range(8)))], "f32") == [None]
    stats = tier.stats()
    assert stats["failures"] >= 2 and not stats["up"] and stats["hits"] == 0
    assert stats["last_error"].startswith(FAILURE[peer.misbehaviour]) and "\n" not in stats["last_error"]
    if peer.misbehaviour == "trickle":  # given up on after the timeout, not after the whole answer
        assert peer.sent < TRICKLED // 4
    if peer.misbehaviour == "endless value":  # cut off at the cap, not after 2 GB in memory
        assert peer.sent < 64 << 20

    failures = stats["failures"]
    for attempt in (1, 2):  # writes meet the peer too: counted, dropped, and the writer goes on
        end_backoff(tier)
        assert tier.put(a_block())
        assert tier.flush()  # the writer took it off the queue: it is alive
        stats = tier.stats()
        assert stats["failures"] == failures + attempt and stats["written"] == 0
        assert stats["dropped_writes"] >= attempt
        assert not stats["up"] and stats["queued_writes"] == 0
    if peer.misbehaviour == "trickle":
        assert peer.sent < TRICKLED // 2


@pytest.mark.parametrize("misbehaviour", ["hello +OK", "nested reply"])
def test_serve_answers_and_reports_the_tier_down(qwen2, tmp_path, misbehaviour):
    """The two that reached the client: a HELLO answered +OK had every completion fail with 500, a
    nested reply came back as 503 "The server is shutting down"."""
    peer = MisbehavingRedis(misbehaviour)
    server = Served(tmp_path / "a.db", qwen2, kv_remote=peer.url, kv_secret=SECRET).wait_ready()
    try:
        for _ in range(2):  # the first meets the peer; the second finds the tier backing off
            done = server.ask([{"role": "user", "content": HISTORY}], temperature=0, max_tokens=4)
            assert done.choices[0].message.content and done.choices[0].finish_reason == "length"
        tier = server.state.engine._cache.remote
        assert tier.flush()  # the replies' blocks: the writer meets the peer on its own
        end_backoff(tier)  # a read once more, the writer idle: the last error is a read's
        assert tier.fetch_run([(b"\1" * 16, tuple(range(8)))], "f32") == [None]
        status, _, body = server.raw("GET", "/health")
        remote = json.loads(body)["kv_remote"]
        assert status == 200 and not remote["up"] and remote["failures"] >= 2
        assert remote["last_error"].startswith(FAILURE[misbehaviour])
        end_backoff(tier)  # then a write meets the peer: the writer thread counts it and goes on
        tier.put(a_block())
        assert tier.flush()  # the writer finished with it (a writer that died would leave it unfinished)
        remote = json.loads(server.raw("GET", "/health")[2])["kv_remote"]
        assert not remote["up"] and remote["failures"] >= 2 and remote["queued_writes"] == 0
    finally:
        server.stop()
        peer.close()
