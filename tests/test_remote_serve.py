"""Two `llama-chat serve`s with separate SQLite files and one Redis (or a 3-node Redis Cluster): a
conversation computed on one is continued on the other from the shared blocks, a dead store only means
computing, and a session exported from one server goes on at the other."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import openai
import pytest

from llama_chat.app.chat.session_cache import kv_salt
from llama_chat.inference import chat_prompt_ids
from redis_servers import REDIS_SERVER, RedisServer, start_cluster
from served import BLOCK, MODEL, SYSTEM, Served, upload

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

SECRET = "a secret the servers share"
HISTORY = "hello the world, then the sun and the rain over the hills " * 3
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(params=["one node", "cluster"])
def store(request, tmp_path):
    """(URL, nodes) of one redis-server, or of a 3-node Redis Cluster."""
    if request.param == "one node":
        nodes = [RedisServer(tmp_path / "redis").start()]
        url = nodes[0].url
    else:
        nodes = start_cluster(tmp_path / "cluster")
        url = f"redis+cluster://127.0.0.1:{nodes[0].port}"
    yield url, nodes
    for node in nodes:
        node.kill()


def served(tmp_path, name: str, model, url: str | None) -> Served:
    """A server on its own SQLite file, sharing the store at `url` (None: no remote tier)."""
    remote = {"kv_remote": url, "kv_secret": SECRET} if url else {}
    return Served(tmp_path / f"{name}.db", model, **remote).wait_ready()


def first_turn(server: Served) -> tuple[list[dict], int]:
    """A conversation answered on `server`, its next turn, and the tokens of its full blocks there (stored,
    then written to the remote tier before this returns)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": HISTORY}]
    reply = server.ask(messages, **GREEDY)
    assert server.state.engine._cache.remote.flush()
    kept = server.state.sessions.store.kv.block_keys(reply.session)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "and then"}]
    return messages, len(kept) * BLOCK


def test_a_conversation_computed_on_one_server_goes_on_at_another(tmp_path, qwen2, store):
    url, _ = store
    a, b = served(tmp_path, "a", qwen2, url), served(tmp_path, "b", qwen2, url)
    try:
        messages, full = first_turn(a)
        assert full >= 4 * BLOCK
        held = chat_prompt_ids(b.model, messages[:-1], False)  # the conversation as it is stored
        assert full == len(held) // BLOCK * BLOCK

        assert len(held) % BLOCK  # a tail after the full blocks

        more = b.ask(messages, **GREEDY)
        usage = more.usage
        # every full block and the tail, from the remote tier: only the new message is computed
        assert usage.prompt_tokens_details.cached_tokens == len(held)
        remote = usage.model_extra["kv_remote"]
        assert remote["choice"] == "fetch" and remote["fetched_tokens"] == full
        assert remote["hits"] == full // BLOCK + 1 and remote["rejected"] == 0 and remote["round_trips"] >= 1
        assert remote["rtt_ms"] is not None
        health = json.loads(b.raw("GET", "/health")[2])
        assert health["kv_remote"]["hits"] == full // BLOCK + 1 and health["kv_remote"]["up"]

        again = b.ask(messages, **GREEDY)  # now RAM holds the blocks; only the tail is read again
        assert again.usage.model_extra["kv_remote"]["choice"] == "local"
        assert again.usage.model_extra["kv_remote"]["hits"] == full // BLOCK + 2
        assert again.usage.prompt_tokens_details.cached_tokens == len(held)
    finally:
        a.stop()
        b.stop()


def test_a_tenants_conversation_goes_on_at_another_server_and_no_other_tenant_reads_it(tmp_path, qwen2):
    redis = RedisServer(tmp_path / "redis").start()
    tenants = {"key-a": "alice", "key-b": "bob"}
    a, b = (Served(tmp_path / f"{name}.db", qwen2, api_key=tenants, kv_remote=redis.url, kv_secret=SECRET)
            for name in "ab")
    try:
        a.wait_ready(), b.wait_ready()

        def ask(server: Served, key: str, messages: list[dict], **extra):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            return client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, **extra)

        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": HISTORY}]
        first = ask(a, "key-a", messages)
        assert a.state.engine._cache.remote.flush()
        names = redis.client().keys()
        assert names and all(kv_salt("alice").hex().encode() in name for name in names)  # her namespace
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and then"}]
        held = len(chat_prompt_ids(b.model, messages[:-1], False))

        theirs = ask(b, "key-b", messages)  # bob, on the server that never saw it: nothing of alice's
        assert theirs.usage.prompt_tokens_details.cached_tokens == 0
        assert theirs.usage.model_extra["kv_remote"]["hits"] == 0
        hers = ask(b, "key-a", messages)  # alice there: every block and the tail, from Redis
        assert hers.usage.prompt_tokens_details.cached_tokens == held
        assert hers.usage.model_extra["kv_remote"]["choice"] == "fetch"
        scoped = ask(b, "key-a", messages, extra_body={"prompt_cache_key": "team-x"})  # her other namespace
        assert scoped.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        a.stop()
        b.stop()
        redis.kill()


def test_with_the_store_dead_the_second_server_computes_the_same_reply(tmp_path, qwen2):
    redis = RedisServer(tmp_path / "redis").start()
    a, b = served(tmp_path, "a", qwen2, redis.url), served(tmp_path, "b", qwen2, redis.url)
    alone = served(tmp_path, "alone", qwen2, None)  # no remote tier: computes all of it
    try:
        messages, _ = first_turn(a)
        redis.kill()
        more = b.ask(messages, **GREEDY)
        assert more.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, not failed
        remote = more.usage.model_extra["kv_remote"]
        # (failures: the read's, and the writer's too where it met the dead store before the usage)
        assert remote["fetched_tokens"] == 0 and remote["failures"] >= 1 and not remote["up"]
        expected = alone.ask(messages, **GREEDY)
        assert "kv_remote" not in (expected.usage.model_extra or {})
        assert more.choices[0].message.content == expected.choices[0].message.content
    finally:
        for server in (a, b, alone):
            server.stop()
        redis.kill()


def test_a_session_exported_from_one_server_goes_on_at_another(tmp_path, qwen2):
    redis = RedisServer(tmp_path / "redis").start()
    a, b = served(tmp_path, "a", qwen2, redis.url), served(tmp_path, "b", qwen2, redis.url)
    try:
        sid = json.loads(a.raw("POST", "/v1/sessions", json.dumps({"system_prompt": SYSTEM}).encode())[2])[
            "id"
        ]
        one = a.ask(HISTORY, extra_body={"session": sid}, **GREEDY)
        assert a.state.engine._cache.remote.flush()
        full = len(a.state.sessions.store.kv.block_keys(sid)) * BLOCK

        for kv in ("0", "1"):  # messages only: the blocks come from Redis; with its KV: from the file
            status, _, data = a.raw("GET", f"/v1/sessions/{sid}/export?kv={kv}")
            assert status == 200
            status, _, body = upload(b, data)
            assert status == 201
            moved = json.loads(body)["ids"][0]
            two = b.ask("and then", extra_body={"session": moved}, **GREEDY)
            assert two.session == moved
            assert two.usage.prompt_tokens_details.cached_tokens >= full  # only the new turn computed
            shown = json.loads(b.raw("GET", f"/v1/sessions/{moved}")[2])["messages"]
            assert [m["content"] for m in shown] == [
                HISTORY, one.choices[0].message.content, "and then", two.choices[0].message.content,
            ]
    finally:
        a.stop()
        b.stop()
        redis.kill()


def test_store_false_writes_nothing_to_the_database_or_the_remote_tier(tmp_path, qwen2):
    redis = RedisServer(tmp_path / "redis").start()
    s = served(tmp_path, "a", qwen2, redis.url)
    try:
        sid = json.loads(s.raw("POST", "/v1/sessions", json.dumps({"system_prompt": SYSTEM}).encode())[2])[
            "id"
        ]
        one = s.ask(HISTORY, extra_body={"session": sid}, **GREEDY)  # stored: its blocks in both tiers
        remote = s.state.engine._cache.remote
        assert remote.flush()

        def written() -> tuple[list[str], list[bytes]]:
            with contextlib.closing(sqlite3.connect(s.state.options.db)) as db:
                return list(db.iterdump()), sorted(redis.client().keys())

        before = written()
        assert before[1]  # the stored turn's blocks went to Redis
        other = "the rain over the hills, then the sun again and the water " * 2  # blocks nobody stored
        turn = s.ask(other, extra_body={"session": sid, "store": False}, **GREEDY)
        assert turn.session is None and turn.model_extra["stored"] is False
        streamed = s.ask(other + "!", extra_body={"session": sid, "store": False}, stream=True, **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        whole = s.ask([{"role": "system", "content": SYSTEM}, {"role": "user", "content": other}],
                      extra_body={"store": False}, **GREEDY)
        assert whole.session is None
        assert remote.flush()
        assert written() == before  # no message, no head moved, no block, nothing in Redis
        shown = json.loads(s.raw("GET", f"/v1/sessions/{sid}")[2])["messages"]
        assert [m["content"] for m in shown] == [HISTORY, one.choices[0].message.content]
    finally:
        s.stop()
        redis.kill()
