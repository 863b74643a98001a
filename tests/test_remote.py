"""The remote KV tier against real redis-server processes: blocks shared between servers, signed, and
a store that dies, stalls, forgets or lies never changes a reply nor loses anything local."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from llama_chat.storage.codec import checksum, encode_kv
from llama_chat.storage.remote import RemoteTier, RemoteTierError
from llama_chat.storage.store import StoredBlock
from redis_servers import REDIS_SERVER, RedisServer, SlowProxy, start_cluster

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


def tier(url: str, secret: str = SECRET, **options) -> RemoteTier:
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
        bad_sum = StoredBlock(good.key, 8, "q6", good.data, "00000000", good.tokens)
        assert planted(ours.seal(bad_sum)[1]) is None  # signed, but its bytes fail their checksum
        assert planted(b"\x00garbage" * 50) is None
        assert planted(["a", "list"]) is None  # not even a string (the server answers WRONGTYPE)
    assert ours.stats()["rejected"] == 7 and ours.stats()["hits"] == 1 and ours.stats()["up"]
    warnings = [r for r in caplog.records if "ignored a block" in r.getMessage()]
    assert len(warnings) == 1  # once, not once per block


def test_a_dead_server_is_a_miss_and_the_tier_comes_back_after_its_backoff(redis_server, caplog):
    remote = tier(redis_server.url, backoff_s=0.3)
    block = make_block(3)
    remote.put(block)
    remote.flush()
    redis_server.kill()
    with caplog.at_level(logging.WARNING):
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None  # skipped: not tried again yet
        assert not remote.put(block)  # dropped while backing off, not queued
    stats = remote.stats()
    assert stats["failures"] == 1 and not stats["up"] and stats["dropped_writes"] == 1
    assert not remote.worth_fetching(4, 10_000, 100.0, 256)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1

    redis_server.start()  # restarted empty (nothing saved): a miss, then written again
    remote._down_until = 0  # the backoff ends (rather than sleeping through it)
    assert remote.fetch(block.key, tuple(block.tokens), "q6") is None and remote.stats()["up"]
    remote.put(block)
    remote.flush()
    assert remote.fetch(block.key, tuple(block.tokens), "q6").data == block.data


def test_a_stalled_server_times_out_and_writes_never_wait(redis_server):
    proxy = SlowProxy(redis_server.port, delay_s=2.0)
    try:
        remote = tier(proxy.url, queue_blocks=2)
        block = make_block(4)
        assert remote.fetch(block.key, tuple(block.tokens), "q6") is None
        assert remote.stats()["failures"] == 1  # a timeout (0.25 s), not a two-second wait
        remote._down_until = 0
        accepted = [remote.put(make_block(i)) for i in range(10)]  # the writer is stuck on the first
        assert not all(accepted) and remote.stats()["dropped_writes"] >= 1
    finally:
        proxy.close()


def test_no_secret_or_a_bad_url_is_refused_with_one_line(redis_server):
    with pytest.raises(RemoteTierError, match="--kv-secret"):
        RemoteTier.from_url(redis_server.url, None, "fp")
    with pytest.raises(RemoteTierError, match="--kv-secret"):
        RemoteTier.from_url(redis_server.url, "", "fp")
    for url in ("http://example.org", "redis://", "redis://host:port", "redis+cluster://h:1/3"):
        with pytest.raises(RemoteTierError, match="--kv-remote"):
            RemoteTier.from_url(url, SECRET, "fp")
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
        assert 0.04 <= rtt < 0.5 and 0.5e6 < rate < 2.5e6  # what the link is, as measured
        n_bytes = remote.estimated_bytes(4)
        assert n_bytes == pytest.approx(remote.stats()["bytes_read"] / 3, rel=0.01)  # four blocks, as read
        fetch_s = rtt + n_bytes / rate
        assert remote.worth_fetching(4, n_bytes, 256 / fetch_s / 2, 256)  # computing takes twice as long
        assert not remote.worth_fetching(4, n_bytes, 256 / fetch_s * 2, 256)  # computing takes half
        assert not remote.worth_fetching(0, 0, 1.0, 0)
        stats = remote.stats()
        assert stats["rtt_ms"] == pytest.approx(rtt * 1000, abs=0.01) and stats["mb_per_s"] > 0
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
