"""Two `llama-chat serve`s at one thread each behind HAProxy, sharing KV through a Redis Cluster, as
deploy/local-cluster.sh starts them (not CI): the time to first token of a continued turn by where its
KV came from, the time a conversation takes to move to the other server, and the output tokens a
second per server.

    .venv/bin/python benchmarks/cluster.py [--model NAME] [--tokens 600] [--migrate-tokens 2000]

- TTFT of a continued turn, p50/p95 over --conversations conversations of about --tokens tokens, each
  built on s1: "ram", the turn sent to s1, whose RAM holds the conversation; "redis", sent to s2, which
  never saw it and reads its blocks and tail from Redis; "recomputed", sent to s2 under a new
  prompt_cache_key, so that nothing of it is found anywhere.
- Migration: for --migrations conversations of about --migrate-tokens tokens, the TTFT of the turn
  on s2 (from Redis) less the same turn's on s1 (from RAM): what moving it costs the user (best, p50
  and p95 of the runs).
- Throughput: --requests replies of --max-tokens a server, --clients a server at a time, sent to s1
  alone, then to s1 and s2 in turn: aggregate completion tokens a second, the best of --rounds rounds
  (alternating, as the machine may be shared).

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from local_cluster import Cluster, request, send  # noqa: E402

FILLER = (
    "The river came down from the hills in spring, wide and brown with snowmelt, and over thousands of "
    "years it cut the valley into the long curve the town now follows. "
)
NEXT = "Sum that up in one sentence."
CHARS_PER_TOKEN = 4.2  # English prose in Qwen2.5's and Gemma 3's vocabularies, near enough for a size


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def built(url: str, model: str, i: int, tokens: int) -> list[dict]:
    """A conversation of about `tokens` tokens answered once at `url`, and its next turn's messages."""
    opening = f"Story {i} ({uuid.uuid4().hex[:8]}): " + FILLER * max(
        1, int(tokens * CHARS_PER_TOKEN / len(FILLER))
    )
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": opening},
    ]
    # its whole prompt computed at one thread: minutes for 2,000 tokens on a busy machine
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    turn = send(url, body, timeout=1800)
    return [*messages, {"role": "assistant", "content": turn.reply}, {"role": "user", "content": NEXT}]


def first_token(url: str, model: str, messages: list[dict], **extra) -> tuple[float, dict]:
    body = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0, **extra}
    turn = send(url, body, stream=True)
    return turn.first_token_s, turn.usage


def percentiles(values: list[float]) -> dict:
    """Milliseconds: the best (on a shared machine, the least disturbed), p50 and p95 of `values`."""
    ms = np.array(values) * 1000
    return {"best": round(float(ms.min()), 1), "p50": round(float(np.percentile(ms, 50)), 1),
            "p95": round(float(np.percentile(ms, 95)), 1), "n": len(values)}


def ttft_by_source(cluster: Cluster, model: str, n: int, tokens: int) -> tuple[dict, int]:
    s1, s2 = (f"http://127.0.0.1:{port}" for port in cluster.servers.values())
    conversations = [built(s1, model, i, tokens) for i in range(n)]
    cluster.wait_written("s1")
    times: dict[str, list[float]] = {"ram": [], "redis": [], "recomputed": []}
    for messages in conversations:
        # s2 first: s1's reply would store this turn's blocks, and s2 would find them in Redis too
        seconds, usage = first_token(s2, model, messages)
        assert usage["kv_remote"]["choice"] == "fetch", usage["kv_remote"]
        times["redis"].append(seconds)
        times["ram"].append(first_token(s1, model, messages)[0])
        seconds, usage = first_token(s2, model, messages, prompt_cache_key=uuid.uuid4().hex)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        times["recomputed"].append(seconds)
        log(f"  {usage['prompt_tokens']} tokens: redis {times['redis'][-1] * 1000:.0f} ms, "
            f"ram {times['ram'][-1] * 1000:.0f} ms, recomputed {seconds * 1000:.0f} ms")
    return {source: percentiles(values) for source, values in times.items()}, usage["prompt_tokens"]


def migration(cluster: Cluster, model: str, n: int, tokens: int) -> dict:
    s1, s2 = (f"http://127.0.0.1:{port}" for port in cluster.servers.values())
    moved, prompt = [], 0
    for i in range(n):
        messages = built(s1, model, 1000 + i, tokens)
        cluster.wait_written("s1")
        elsewhere, usage = first_token(s2, model, messages)
        here = first_token(s1, model, messages)[0]
        moved.append(elsewhere - here)
        prompt = usage["prompt_tokens"]
        log(f"  {prompt} tokens: from Redis {elsewhere * 1000:.0f} ms, from RAM {here * 1000:.0f} ms")
    return {**percentiles(moved), "prompt_tokens": prompt}


def throughput(urls: list[str], model: str, requests: int, clients: int, max_tokens: int) -> float:
    """Output tokens a second of `requests` replies a server, `clients` a server at a time."""

    def one(i: int) -> int:
        messages = [{"role": "user", "content": f"Write a short story about a river, number {i}."}]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return send(urls[i % len(urls)], body).usage["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients * len(urls)) as pool:
        tokens = sum(pool.map(one, range(requests * len(urls))))
    return round(tokens / (time.perf_counter() - t0), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a known model's name or a .gguf path (default: the default model)")
    parser.add_argument("--only", choices=["ttft", "migration", "throughput"], help="one measure alone")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--migrations", type=int, default=3)
    parser.add_argument("--migrate-tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llama-chat-cluster-") as folder:
        cluster = Cluster(Path(folder), args.model, servers=2, options=("--cache-ram", "1024")).start()
        try:
            result = measured(cluster, args)
        finally:
            cluster.stop()
    print(json.dumps(result))
    return 0


def measured(cluster: Cluster, args) -> dict:
    model = json.loads(request(cluster.url, "GET", "/v1/models")[2])["data"][0]["id"]
    result = {"model": model, "cpu": cpu_name(), "threads_per_server": 1}
    if args.only in (None, "ttft"):
        log(f"{model}: TTFT of a continued turn by where its KV comes from")
        result["ttft_ms"], result["ttft_prompt_tokens"] = ttft_by_source(
            cluster, model, args.conversations, args.tokens
        )
        log(f"  {result['ttft_ms']}")
    if args.only in (None, "migration"):
        log(f"{model}: a conversation moved to the other server")
        result["migration_ms"] = migration(cluster, model, args.migrations, args.migrate_tokens)
        log(f"  {result['migration_ms']}")
    if args.only in (None, "throughput"):
        log(f"{model}: output tokens a second, 1 then 2 servers")
        servers = [f"http://127.0.0.1:{port}" for port in cluster.servers.values()]
        rates = {"1": 0.0, "2": 0.0}
        for _ in range(args.rounds):
            for n in (1, 2):
                rate = throughput(servers[:n], model, args.requests, args.clients, args.max_tokens)
                log(f"  {n} server(s): {rate} tok/s")
                rates[str(n)] = max(rates[str(n)], rate)
        result["output_tok_s"] = rates
    return result


if __name__ == "__main__":
    sys.exit(main())
