"""The remote KV tier against real redis-server processes: blocks shared between servers, signed, and
a store that dies, stalls, forgets or lies never changes a reply nor loses anything local."""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
import time

import numpy as np
import pytest

from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import stream_text
from llama_chat.app.cli import main
from llama_chat.inference import GenerationStats, SamplingParams, load_model
from llama_chat.inference.kv_cache import DEFAULT_BLOCK_SIZE
from llama_chat.storage import ChatStore, Session
from llama_chat.storage.codec import checksum, encode_kv
from llama_chat.storage.exchange import export_session, import_session
from llama_chat.storage.records import StoredBlock
from llama_chat.storage.remote import RemoteTier, RemoteTierError
from llama_chat.storage.remote_wire import DEFAULT_TIMEOUT_S
from redis_servers import REDIS_SERVER, RedisServer, SlowProxy, end_backoff, start_cluster

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

SECRET = "a secret the servers share"


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture
def redis_cluster(tmp_path):
    nodes = start_cluster(tmp_path / "cluster")
    yield nodes
    for node in nodes:
        node.kill()


def make_block(i: int, n_tokens: int = 8, scale: int = 1) -> StoredBlock:
    rng = np.random.default_rng(i)
    k = rng.standard_normal((2, 2, n_tokens, 16 * scale)).astype(np.float32)
    data = encode_kv(k, -k, "q6")
    return StoredBlock(bytes([i]) * 16, n_tokens, "q6", data, checksum(data), list(range(i, i + n_tokens)))


def run_of(blocks):
    return [(b.key, tuple(b.tokens)) for b in blocks]


# a busy machine (the suite beside a CPU burner) can take longer than the tier's 0.25 s to answer a
# healthy local Redis: then the tier is rightly called down and a test's reads miss. Tests of healthy
# stores wait longer; the tests of timeouts name the default.
BUSY_TIMEOUT_S = 5.0


def tier(url: str, secret: str = SECRET, **options) -> RemoteTier:
    options.setdefault("timeout_s", BUSY_TIMEOUT_S)
    return RemoteTier.from_url(url, secret, "model-fingerprint", **options)


def test_a_block_written_by_one_server_is_read_by_another(redis_server):
    writer, reader = tier(redis_server.url), tier(redis_server.url)
    blocks = [make_block(i) for i in range(5)]
    assert all(writer.put(b) for b in blocks)
    assert writer.flush()
    got = reader.fetch_run(run_of(blocks) + [(b"\xff" * 16, tuple(range(8)))], "q6")
    assert [g.data for g in got[:5]] == [b.data for b in blocks]
    assert got[0].tokens == blocks[0].tokens and got[5] is None
    assert reader.fetch(blocks[0].key, tuple(blocks[0].tokens), "q4") is None  # another codec: another key
    stats = reader.stats()
    assert (stats["hits"], stats["misses"], stats["rejected"]) == (5, 2, 0)
    assert stats["bytes_read"] > sum(len(b.data) for b in blocks)
    assert redis_server.client().ttl(writer.block_name(blocks[0].key, "q6")) > 0  # bounded by a TTL


def test_blocks_not_signed_with_the_secret_or_not_of_their_tokens_are_ignored(redis_server, caplog):
    ours, theirs = tier(redis_server.url), tier(redis_server.url, secret="another secret")
    raw = redis_server.client()
    good = make_block(1)
    name = ours.block_name(good.key, "q6")

    def planted(value) -> StoredBlock | None:
        raw.delete(name)
        if isinstance(value, list):
            raw.rpush(name, *value)
        else:
            raw.set(name, value)
        return ours.fetch(good.key, tuple(good.tokens), "q6")

    with caplog.at_level(logging.WARNING):
        assert planted(ours.seal(good)[1]).data == good.data  # signed by us: used
        assert planted(good.data) is None  # unsigned: the bare encoded block
        assert planted(theirs.seal(good)[1]) is None  # signed with another secret
        other_tokens = StoredBlock(good.key, 8, "q6", good.data, good.checksum, list(range(100, 108)))
        assert planted(ours.seal(other_tokens)[1]) is None  # signed, but not the tokens its key names
        elsewhere = make_block(2)
        assert planted(ours.seal(elsewhere)[1]) is None  # a signed block copied under another key
        assert planted(b"\x00garbage" * 50) is None
        assert planted(["a", "list"]) is None  # not even a string (the server answers WRONGTYPE)
    assert ours.stats()["rejected"] == 6 and ours.stats()["hits"] == 1 and ours.stats()["up"]
    warnings = [r for r in caplog.records if "ignored a block" in r.getMessage()]
    assert len(warnings) == 1  # once, not once per block


def test_a_namespaces_blocks_are_read_only_in_that_namespace(redis_server):
    """Tenants' blocks (vLLM's cache_salt): a name and a signing key per namespace, so the same prefix key
    of two tenants are two blocks, and one copied into another's name is rejected."""
    writer, reader = tier(redis_server.url), tier(redis_server.url)
    alice, bob = b"a" * 16, b"b" * 16
    block = make_block(3)
    assert writer.put(block, alice) and writer.flush()
    run = run_of([block])
    assert reader.fetch_run(run, "q6", alice)[0].data == block.data
    assert reader.fetch_run(run, "q6", bob) == [None] and reader.fetch_run(run, "q6") == [None]
    assert writer.signing_key(alice) not in (writer.signing_key(bob), writer.signing_key(None), writer.secret)

    raw = redis_server.client()
    for other in (bob, None):  # alice's signed value planted under bob's name, or the shared one
        raw.set(reader.block_name(block.key, "q6", other), raw.get(reader.block_name(block.key, "q6", alice)))
        assert reader.fetch_run(run, "q6", other) == [None]
    assert reader.stats()["rejected"] == 2 and reader.stats()["hits"] == 1


def test_a_dead_server_is_a_miss_and_the_tier_comes_back_after_its_backoff(redis_server, caplog):
    remote = tier(redis_server.url)
    block = make_block(3)
    remote.put(block)
    remote.flush()
    redis_server.kill()
    with caplog.at_level(logging.WARNING):
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None  # skipped: not tried again yet
        assert remote.put(block) and remote.flush()  # the writer meets the dead server on its own
        assert not remote.put(block)  # dropped while the writer backs off, not queued
    stats = remote.stats()
    assert stats["failures"] == 2 and not stats["up"] and stats["dropped_writes"] == 2
    assert not remote.worth_fetching(4, 10_000, 100.0, 256)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1

    redis_server.start()  # restarted empty (nothing saved): a miss, then written again
    end_backoff(remote)
    assert remote.fetch(block.key, tuple(block.tokens), "q6") is None and remote.stats()["up"]
    remote.put(block)
    remote.flush()
    assert remote.fetch(block.key, tuple(block.tokens), "q6").data == block.data


def test_a_stalled_server_times_out_and_writes_never_wait(redis_server):
    proxy = SlowProxy(redis_server.port, delay_s=2.0)
    try:
        remote = tier(proxy.url, timeout_s=DEFAULT_TIMEOUT_S)
        remote.queue_bytes = 2 * len(remote.seal(make_block(0))[1])  # two blocks wait, no more
        block = make_block(4)
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None
        assert remote.stats()["failures"] == 1  # a timeout (0.25 s), not a two-second wait
        end_backoff(remote)
        accepted = [remote.put(make_block(i)) for i in range(10)]  # the writer is stuck on the first
        assert accepted == [True, True] + [False] * 8 and remote.stats()["dropped_writes"] == 8
    finally:
        proxy.close()


def test_a_burst_of_blocks_waits_for_the_writer_within_its_bytes(redis_server):
    """The queue is bounded in bytes (256 MB), not blocks: five new long conversations at once are 300
    blocks, and a count of 256 dropped their last ones while the writer was busy with the first."""
    proxy = SlowProxy(redis_server.port, delay_s=0.3)
    try:
        remote = tier(proxy.url)
        blocks = [make_block(i) for i in range(100)]
        assert all(remote.put(block) for block in blocks * 3)
        assert remote.flush(60) and remote.stats()["written"] == 300 and remote.stats()["dropped_writes"] == 0
    finally:
        proxy.close()


def test_a_write_under_way_is_still_counted_as_queued(redis_server):
    """queued_writes is what an operator (and the cluster's tests) wait on before stopping a server: a
    batch the writer has taken off the queue but not yet written is still to be written. (It read the
    queue's length: 0 while the last batch crossed the network, and a server killed then lost it.)"""
    proxy = SlowProxy(redis_server.port, delay_s=0.5)
    try:
        remote = tier(proxy.url)
        assert remote.put(make_block(1))
        wait_for(lambda: remote._queue.qsize() == 0)  # taken: connecting, then writing, for seconds
        stats = remote.stats()
        assert stats["written"] == 0 and stats["queued_writes"] == 1
        assert remote.flush(30)
        stats = remote.stats()
        assert stats["written"] == 1 and stats["queued_writes"] == 0
    finally:
        proxy.close()


def test_a_write_slower_than_a_read_may_wait_is_written_and_the_tier_stays_up(redis_server):
    """Nobody waits on the writer thread: a store answering in 0.6 s (a busy machine's) is too slow for a
    read, which rather computes, but not for a write. Called down by one slow write, the tier would drop
    every block queued in its backoff (a cluster's server lost a conversation's second turn so); and a
    read that times out backs off reads alone: the writer goes on (a cluster's server whose first read
    timed out dropped all 242 blocks of its conversations, and the next server computed them)."""
    proxy = SlowProxy(redis_server.port, delay_s=0.3)
    try:
        remote = tier(proxy.url, timeout_s=DEFAULT_TIMEOUT_S)
        assert remote.put(make_block(1)) and remote.flush(30)
        stats = remote.stats()
        assert stats["written"] == 1 and stats["failures"] == 0 and stats["up"]
        assert remote.put(make_block(2)) and remote.flush(30) and remote.stats()["written"] == 2
        block = make_block(1)
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None  # a read: past its 0.25 s
        assert remote.stats()["failures"] == 1 and not remote.stats()["up"]
        assert remote.put(make_block(3)) and remote.flush(30)  # while reads back off
        assert remote.stats()["written"] == 3 and remote.stats()["dropped_writes"] == 0
    finally:
        proxy.close()


def test_a_slow_link_that_keeps_pace_is_read_to_the_end(redis_server):
    """The timeout bounds an answer's first byte and each 64 KiB after it, not the whole answer: 1.4 MB
    at 0.5 MB/s takes 2.8 s, well past a 1 s timeout, and is read. (The timeout leaves a busy machine's
    threads most of a second between two pieces; a trickle is cut off after it: test_remote_peers.py.)"""
    blocks = [make_block(i, n_tokens=64, scale=16) for i in range(12)]
    writer = tier(redis_server.url)
    assert all(writer.put(b) for b in blocks) and writer.flush()
    far = SlowProxy(redis_server.port, delay_s=0.02, bytes_per_s=0.5e6)
    try:
        reader = tier(far.url, timeout_s=1.0)
        assert [g.data for g in reader.fetch_run(run_of(blocks), "q6")] == [b.data for b in blocks]
        assert reader.stats()["failures"] == 0 and reader.stats()["bytes_read"] > 1.3e6
    finally:
        far.close()


def test_no_secret_or_a_bad_url_is_refused_with_one_line(redis_server):
    with pytest.raises(RemoteTierError, match="--kv-secret"):
        RemoteTier.from_url(redis_server.url, None, "fp")
    with pytest.raises(RemoteTierError, match="--kv-secret"):
        RemoteTier.from_url(redis_server.url, "", "fp")
    for url in ("http://example.org", "redis://", "redis://:pw@host:port", "redis+cluster://h:1/3"):
        with pytest.raises(RemoteTierError, match="--kv-remote") as refused:
            RemoteTier.from_url(url, SECRET, "fp")
        assert ":pw@" not in str(refused.value)
    assert "hunter2" not in tier(f"redis://:hunter2@127.0.0.1:{redis_server.port}/2").stats()["url"]


def test_fetch_or_compute_follows_the_measured_link(redis_server):
    far = SlowProxy(redis_server.port, delay_s=0.02, bytes_per_s=2e6)  # 40 ms round trips, 2 MB/s
    try:
        remote = tier(far.url, timeout_s=2.0)
        blocks = [make_block(i, n_tokens=64, scale=8) for i in range(4)]
        assert remote.worth_fetching(4, 10**6, 500.0, 256)  # nothing measured: fetching measures
        for b in blocks:
            remote.put(b)
        remote.flush()
        for _ in range(3):
            assert all(remote.fetch_run(run_of(blocks), "q6"))
        rtt, rate = remote.rtt_s.value, remote.bytes_per_s.value
        # what the link is, as measured: its two delays are a floor that a busy machine only adds to
        assert rtt >= 2 * far.delay_s and rate is not None
        n_bytes = remote.estimated_bytes(4)
        assert n_bytes == pytest.approx(remote.stats()["bytes_read"] / 3, rel=0.01)  # four blocks, as read
        fetch_s = rtt + n_bytes / rate
        assert remote.worth_fetching(4, n_bytes, 256 / fetch_s / 2, 256)  # computing takes twice as long
        assert not remote.worth_fetching(4, n_bytes, 256 / fetch_s * 2, 256)  # computing takes half
        assert not remote.worth_fetching(0, 0, 1.0, 0)
        stats = remote.stats()
        # as measured
        assert stats["rtt_ms"] == round(rtt * 1000, 2) and stats["mb_per_s"] == round(rate / 1e6, 1)
    finally:
        far.close()


def test_a_cluster_spreads_the_blocks_over_its_nodes(redis_cluster):
    url = f"redis+cluster://127.0.0.1:{redis_cluster[1].port}"
    writer, reader = tier(url), tier(url)
    blocks = [make_block(i) for i in range(24)]
    for b in blocks:
        writer.put(b)
    assert writer.flush()
    assert [g.data for g in reader.fetch_run(run_of(blocks), "q6")] == [b.data for b in blocks]
    assert all(node.client().dbsize() > 0 for node in redis_cluster)
    redis_cluster[2].kill()  # a node dies: a miss, then backing off
    assert reader.fetch_run(run_of(blocks), "q6") == [None] * 24
    assert reader.stats()["failures"] == 1


def test_a_flushed_or_evicted_store_is_a_miss(redis_server):
    remote = tier(redis_server.url)
    block = make_block(5)
    remote.put(block)
    remote.flush()
    redis_server.client().flushall()
    assert remote.fetch(block.key, tuple(block.tokens), "q6") is None
    assert remote.stats()["misses"] == 1 and remote.stats()["up"]


# -- two servers sharing one store ---------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0)
HISTORY = "hello the world, then the sun and the rain over the hills " * 3


@pytest.fixture
def qwen2(tiny_model_paths):
    return tiny_model_paths["qwen2"]


def server(model_path, db, url: str | None, secret: str = SECRET, **options) -> ChatEngine:
    """A fresh process's engine on its own SQLite file, with the remote tier at `url` (None: none).
    Blocks are stored lossless (f32), so a reply read from blocks is the reply computed in full: a
    random tiny model flips a greedy choice on a lossy codec's rounding."""
    model = load_model(model_path, block_size=8)
    options.setdefault("timeout_s", BUSY_TIMEOUT_S)
    remote = RemoteTier.from_url(url, secret, model.fingerprint, **options) if url else None
    return ChatEngine(model, ChatStore(db), codec="f32", remote=remote)


def chat(
    engine: ChatEngine, session, text: str, max_tokens: int = 8, during=None
) -> tuple[str, GenerationStats]:
    """A greedy reply; `during()` runs once its first piece is out (its blocks were looked for, the
    new ones are not written yet)."""
    stats = GenerationStats()
    pieces = []
    for piece in stream_text(
        engine.reply(session, text, sampling=GREEDY, max_tokens=max_tokens, stats=stats)
    ):
        if not pieces and during is not None:
            during()
        pieces.append(piece)
    return "".join(pieces), stats


def move(source: ChatEngine, session_id: str, target: ChatEngine, tmp_path) -> Session:
    """The session's messages (no KV) carried to another server, as `sessions export --no-kv` does."""
    path = tmp_path / f"move-{session_id}.llamachat"
    export_session(source._store, session_id, path, with_kv=False)
    result = import_session(target._store, path, model_fingerprint=target.model_info.fingerprint)
    path.unlink()
    return target._store.get_session(result.session_ids[0])


def moved_conversation(qwen2, tmp_path, url: str, title: str):
    """A conversation computed on a first server (its blocks written to the tier at `url`) and its
    messages moved to a second server: (first, second, the session on each)."""
    first, second = server(qwen2, tmp_path / "a.db", url), server(qwen2, tmp_path / "b.db", url)
    session = first.new_session(title)
    chat(first, session, HISTORY)
    first._cache.remote.flush()
    return first, second, session, move(first, session.id, second, tmp_path)


def test_a_conversation_goes_on_at_a_second_server_from_the_shared_store(
    qwen2, tmp_path, redis_server, capsys
):
    shared = ["--model", str(qwen2), "--kv-remote", redis_server.url, "--kv-secret", SECRET]
    ask = ["ask", "--temp", "0", "--max-tokens", "6"]
    assert main(["--db", str(tmp_path / "a.db"), *shared, *ask, "--new-session", HISTORY]) == 0
    session_id = next(w.split()[1] for w in capsys.readouterr().err.splitlines() if w.startswith("session "))
    a = ChatStore(tmp_path / "a.db")
    n_blocks = len(a.kv.block_keys(session_id))
    assert n_blocks >= 2
    wait_for(lambda: redis_server.client().dbsize() >= n_blocks)  # written behind the reply

    assert (
        main(["--db", str(tmp_path / "a.db"), "export", "--no-kv", session_id, "-o", str(tmp_path / "s")])
        == 0
    )
    assert main(["--db", str(tmp_path / "b.db"), "import", str(tmp_path / "s")]) == 0
    moved = capsys.readouterr().out.split()[-1]
    assert main(["--db", str(tmp_path / "b.db"), *shared, *ask, "--session", moved, "and then"]) == 0
    out, err = capsys.readouterr()
    restored = re.search(r"\[([\d,]+) of ([\d,]+) tokens restored \(([\d,]+) from the remote tier\)", err)
    B = DEFAULT_BLOCK_SIZE  # what the command line uses
    # every full block and the tail after them, from Redis: only the new turn is computed
    assert restored and int(restored[3]) == int(restored[1]) == int(restored[2]) > n_blocks * B
    prompt, prefilled = map(int, re.search(r"\[(\d+) prompt tokens, (\d+) prefilled", err).groups())
    assert prefilled == prompt - int(restored[1])

    assert main(["--db", str(tmp_path / "c.db"), "import", str(tmp_path / "s")]) == 0
    alone = capsys.readouterr().out.split()[-1]
    assert (
        main(["--db", str(tmp_path / "c.db"), "--model", str(qwen2), *ask, "--session", alone, "and then"])
        == 0
    )
    assert capsys.readouterr().out == out  # the same reply as a server without the tier, computing it all


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the background writes did not land"
        time.sleep(0.02)


def test_two_servers_share_blocks_through_a_cluster(qwen2, tmp_path, redis_cluster):
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}"
    first, second = server(qwen2, tmp_path / "a.db", url), server(qwen2, tmp_path / "b.db", url)
    session = first.new_session("shared", system_prompt="the sun")
    chat(first, session, HISTORY)
    first._cache.remote.flush()
    moved = move(first, session.id, second, tmp_path)
    info = second.resume(moved)
    assert info.tokens % 8  # a tail after the full blocks: it comes through the cluster too
    assert info.remote == info.restored == info.tokens >= 32
    keys = first._store.kv.block_keys(session.id)
    assert second._store.kv.stored_keys(keys) == set()  # read into RAM: no SQLite before the first token
    reply, stats = chat(second, moved, "and then")
    assert stats.prefilled_tokens == stats.prompt_tokens - info.tokens
    # then stored with the reply's snapshot, as read (not encoded again), and not sent back
    assert second._store.kv.stored_keys(keys) == set(keys)
    assert all(
        second._store.kv.load_block(k, second.model_info.fingerprint).data
        == first._store.kv.load_block(k, first.model_info.fingerprint).data
        for k in keys
    )
    second._cache.remote.flush()
    assert second._cache.remote.stats()["written"] < len(keys)  # only the new turn's blocks, if any
    assert chat(first, first._store.get_session(session.id), "and then")[0] == reply
    assert all(node.client().dbsize() > 0 for node in redis_cluster)


def test_blocks_read_beyond_the_memory_bound_are_computed_instead(qwen2, tmp_path, redis_server):
    first, second, session, moved = moved_conversation(qwen2, tmp_path, redis_server.url, "bounded")
    second._cache.fetched.max_bytes = 1  # every block read is forgotten at once
    info = second.resume(moved)
    assert not second._cache.fetched.blocks and info.restored < 8  # nothing kept: the blocks are computed
    assert (
        chat(second, moved, "and then")[0] == chat(first, first._store.get_session(session.id), "and then")[0]
    )


def test_a_returning_conversation_reads_its_blocks_and_tail_in_one_round_trip(qwen2, tmp_path, redis_server):
    """The tail is what a returning conversation asks for last: it comes with the blocks, not a round
    trip after them (one more latency on a far link)."""
    first, second, session, moved = moved_conversation(qwen2, tmp_path, redis_server.url, "one trip")
    tier = second._cache.remote
    tier.fetch(b"\0" * 32, (1,), "f32")  # this thread's connection made, its latency measured
    before = tier.stats()["round_trips"]
    info = second.resume(moved)
    assert info.tokens % 8 and info.remote == info.restored == info.tokens  # the blocks and the tail
    assert tier.stats()["round_trips"] - before == 1
    again = first._store.get_session(session.id)
    assert chat(second, moved, "and then")[0] == chat(first, again, "and then")[0]


def test_a_tail_alone_is_read_before_the_reply_is_queued_and_only_where_none_is_here(
    qwen2, tmp_path, redis_server
):
    """Every full block stored here but not the conversation's tail (another server's turn left it): the
    tail is read when the reply is submitted, in one round trip, and opening reads nothing more. Where
    the session's own tail is here, nothing is read at all."""
    first, second, session, moved = moved_conversation(qwen2, tmp_path, redis_server.url, "tail only")
    info = second.resume(moved)
    second._cache.snapshot(moved, second._cache.seq(moved.id))  # its blocks and its tail stored here now
    assert info.tokens % 8 and info.remote == info.tokens
    with sqlite3.connect(tmp_path / "b.db") as db:  # as if the tail here were another server's
        db.execute("DELETE FROM session_tails")
    for tail_here in (False, True):
        third = server(qwen2, tmp_path / "b.db", redis_server.url)  # a fresh process: nothing in RAM
        tier = third._cache.remote
        tier.fetch(b"\0" * 32, (1,), "f32")  # connected, latency measured
        before = tier.stats()["round_trips"]
        read = third._cache.prefetch(moved)
        assert tier.stats()["round_trips"] - before == (0 if tail_here else 1)
        _, info = third._cache.open(moved, read)
        assert tier.stats()["round_trips"] - before == (0 if tail_here else 1)  # open read nothing
        assert info.restored == info.tokens and info.remote == (0 if tail_here else info.tokens % 8)
        third._cache.snapshot(moved, third._cache.seq(moved.id))  # now the tail is here too
    again = first._store.get_session(session.id)
    assert chat(third, moved, "and then")[0] == chat(first, again, "and then")[0]


def test_a_slow_store_holds_up_only_the_reply_that_reads_from_it(qwen2, tmp_path, redis_server, monkeypatch):
    """Blocks are read on the thread that submits the reply, not on the scheduler's: while one returning
    conversation waits on the store, another conversation's reply is decoded to its end."""
    first, second, session, moved = moved_conversation(qwen2, tmp_path, redis_server.url, "far away")
    tier = second._cache.remote
    reading, go_on = threading.Event(), threading.Event()
    real_read = tier._read

    def stalled_read(client, names):
        reading.set()
        go_on.wait(60)  # the store answers when the test says so (or after a minute: then it fails)
        return real_read(client, names)

    monkeypatch.setattr(tier, "_read", stalled_read)
    returning: list[str] = []
    waiting = threading.Thread(target=lambda: returning.append(chat(second, moved, "and then")[0]))
    waiting.start()
    assert reading.wait(30)
    local = second.new_session("here")
    assert chat(second, local, "hello the world", max_tokens=12)[0]  # decoded while the read waits
    assert waiting.is_alive() and not returning
    go_on.set()
    waiting.join(60)
    assert returning == [chat(first, first._store.get_session(session.id), "and then")[0]]
    assert tier.stats()["hits"] > 0


def test_where_the_rule_computes_the_blocks_no_tail_is_asked_for(qwen2, tmp_path, redis_server):
    """A tail is shorter than a block: without the blocks before it (the link was measured slower than
    computing them) no server stored one for what is left, so no round trip is spent looking."""
    first, second, session, moved = moved_conversation(qwen2, tmp_path, redis_server.url, "far")
    tier = second._cache.remote
    tier.rtt_s.add(5.0)  # as measured on a far, slow link
    tier.bytes_per_s.add(1000.0)
    second._cache.note_prefill(GenerationStats(prefilled_tokens=100, prefill_s=1.0))  # 100 tokens/s
    info = second.resume(moved)
    assert info.remote_read.choice == "compute" and info.remote == info.restored == 0
    assert tier.stats()["hits"] == tier.stats()["misses"] == 0
    again = first._store.get_session(session.id)
    assert chat(second, moved, "and then")[0] == chat(first, again, "and then")[0]


def test_blocks_of_another_secret_are_not_used(qwen2, tmp_path, redis_server):
    stranger = server(qwen2, tmp_path / "a.db", redis_server.url, secret="not our secret")
    session = stranger.new_session("planted")
    chat(stranger, session, HISTORY)
    stranger._cache.remote.flush()
    assert redis_server.client().dbsize() > 0
    ours = server(qwen2, tmp_path / "b.db", redis_server.url)
    moved = move(stranger, session.id, ours, tmp_path)
    info = ours.resume(moved)
    assert info.remote == 0 and info.restored == 0 and ours._cache.remote.stats()["rejected"] > 0
    alone = server(qwen2, tmp_path / "c.db", None)
    assert (
        chat(ours, moved, "and then")[0]
        == chat(alone, move(stranger, session.id, alone, tmp_path), "and then")[0]
    )


def test_an_imported_sessions_blocks_never_travel(qwen2, tmp_path, redis_server):
    first = server(qwen2, tmp_path / "a.db", None)
    session = first.new_session("imported")
    chat(first, session, HISTORY)
    export_session(first._store, session.id, tmp_path / "with-kv.llamachat")  # with its KV: untrusted there
    second = server(qwen2, tmp_path / "b.db", redis_server.url)
    result = import_session(
        second._store, tmp_path / "with-kv.llamachat", model_fingerprint=second.model_info.fingerprint
    )
    imported = second._store.get_session(result.session_ids[0])
    assert imported.kv_namespace is not None
    chat(second, imported, "and then")
    second._cache.remote.flush()
    assert redis_server.client().dbsize() == 0  # nothing written from the import's namespace
    assert second._cache.remote.stats()["round_trips"] == 0  # nor read for it


def test_every_reply_survives_a_store_that_dies_forgets_lies_and_stalls(qwen2, tmp_path, redis_server):
    """Turns of one conversation land on two servers in turn (a load balancer); between turns the
    store is killed, restarted, flushed, filled with garbage and slowed. The replies are those of one
    server without any tier, and every message and block stays where it was stored."""
    link = SlowProxy(redis_server.port)
    # (always_fetch: the tiny model computes a few blocks faster than a loaded machine reads them, and
    # the point here is what reading does when the store misbehaves)
    servers = [
        server(
            qwen2,
            tmp_path / f"{n}.db",
            link.url,
            backoff_s=0.05,
            always_fetch=True,
            timeout_s=DEFAULT_TIMEOUT_S,
        )
        for n in "ab"
    ]
    alone = server(qwen2, tmp_path / "alone.db", None)

    def garbage():
        raw = redis_server.client()
        for name in raw.keys("*"):
            raw.set(name, b"\x00not a block" * 40)

    chaos = [
        lambda: None,
        lambda: None,
        "kill mid-reply",
        redis_server.start,
        lambda: redis_server.client().flushall(),
        garbage,
        lambda: setattr(link, "delay_s", 1.0),  # far slower than the tier's timeouts
        lambda: setattr(link, "delay_s", 0.0),
    ]
    expected_session = alone.new_session("alone", system_prompt="the sun")
    session = servers[0].new_session("balanced", system_prompt="the sun")
    try:
        for turn, event in enumerate(chaos):
            here = servers[turn % 2]
            if turn:
                session = move(servers[(turn - 1) % 2], session.id, here, tmp_path)
            during = redis_server.kill if event == "kill mid-reply" else None
            if during is None:
                event()
            for tier in (s._cache.remote for s in servers):
                end_backoff(tier)
            text = f"t{turn}"
            info = here.resume(session)
            reply, stats = chat(here, session, text, max_tokens=4, during=during)
            assert stats.prompt_tokens > info.tokens  # (no turn dropped from the window, nothing shifted)
            expected, _ = chat(alone, expected_session, text, max_tokens=4)
            assert reply == expected, f"turn {turn}"
            here._cache.remote.flush()
            session = here._store.get_session(session.id)
    finally:
        link.close()
    stats = [s._cache.remote.stats() for s in servers]
    assert sum(s["hits"] for s in stats) > 0  # the tier was used when it worked
    assert sum(s["rejected"] for s in stats) > 0 and sum(s["failures"] for s in stats) > 0
    for s in servers:  # nothing local lost: every session whole, every block it lists stored
        for stored in s._store.list_sessions():
            assert [m.role for m in s._store.path(stored.head_id)][-2:] == ["user", "assistant"]
            keys = s._store.kv.block_keys(stored.id)
            assert s._store.kv.stored_keys(keys) == set(keys)


def test_kv_fetch_always_reads_what_the_measured_rule_would_compute(redis_server):
    """--kv-fetch always (a fast store on a machine too busy to measure it well): the blocks a
    conversation lacks are read whatever the round trips measured; measured (the default) computes them
    where that is faster."""
    from llama_chat.app.chat.build import EngineOptions, open_remote

    tiers = [
        open_remote(EngineOptions(kv_remote=redis_server.url, kv_secret=SECRET, kv_fetch=how), "fp")
        for how in ("measured", "always")
    ]
    for remote in tiers:
        remote.rtt_s.add(1.0)  # a round trip of a second: slower than computing 16 tokens at 1,000/s
    assert [remote.worth_fetching(1, 1000, 1000.0, 16) for remote in tiers] == [False, True]
    for remote in tiers:
        remote.close()


def test_kv_fetch_always_waits_for_a_store_slower_than_the_measured_rules_timeout(redis_server):
    """A store answering in 0.3 s (a machine busy enough to hold up Redis): the measured rule's read
    gives up after 0.25 s and computes, backing the reads off; told to always fetch, the read waits for
    the block (a cluster's failover computed a dead server's conversations when it gave up so)."""
    from llama_chat.app.chat.build import EngineOptions, open_remote

    proxy = SlowProxy(redis_server.port, delay_s=0.3)
    try:
        block = make_block(1)
        writer = tier(redis_server.url)
        assert writer.put(block) and writer.flush(30)
        writer.close()
        for how, read in (("measured", False), ("always", True)):
            options = EngineOptions(kv_remote=proxy.url, kv_secret=SECRET, kv_fetch=how)
            remote = open_remote(options, "model-fingerprint")
            got = remote.fetch(block.key, tuple(block.tokens), "q6")
            assert (got is not None, remote.stats()["up"]) == (read, read), (how, remote.stats())
            remote.close()
    finally:
        proxy.close()


def test_the_command_line_refuses_a_tier_without_a_secret(qwen2, tmp_path, redis_server, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_CHAT_KV_SECRET", raising=False)
    db = ["--db", str(tmp_path / "a.db"), "--model", str(qwen2)]
    assert main([*db, "--kv-remote", redis_server.url, "ask", "--new-session", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-secret" in err[0] and "Traceback" not in err[0]
    assert ChatStore(tmp_path / "a.db").list_sessions() == []  # nothing stored for it
    monkeypatch.setenv("LLAMA_CHAT_KV_SECRET", SECRET)
    assert (
        main([*db, "--kv-remote", redis_server.url, "ask", "--new-session", "--max-tokens", "2", "hello"])
        == 0
    )
