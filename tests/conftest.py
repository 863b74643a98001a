"""Shared fixtures: tiny models per architecture, the two real models, and an isolated user directory.
Ready for pytest-xdist (`-n auto`: workers by free memory; `--dist loadgroup` from pyproject.toml): see
pytest_configure, pytest_xdist_auto_num_workers and pytest_collection_modifyitems."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from served import Served
from tiny_models import ARCHS, write_tiny_model

FIXTURES = Path(__file__).parent / "fixtures"
REAL_CACHE: Path | None = None  # the user's real cache, remembered before tests isolate it


def pytest_configure(config):
    global REAL_CACHE
    from llama_chat.inference.catalog import cache_dir

    REAL_CACHE = cache_dir().parent
    # Compiled kernels are shared by every test and every process a test starts (each with its own
    # isolated cache folder): compiled once per machine, as for a user, not once per subprocess.
    os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir() / "numba"))
    if _starts_workers(config):
        # Two workers compiling one kernel at once could each number a new cache file 1 and save an
        # index over the other's (numba's cache has no lock): compiled before any worker starts, the
        # workers only load them (compile_kernels compiles every signature the tests use). In a child
        # process: the compiled code would stay in this one, which does nothing with it, for the run.
        subprocess.run([sys.executable, "-c", COMPILE_KERNELS], check=True)


COMPILE_KERNELS = """
from llama_chat.inference.warmup import compile_kernels, compile_long_prompts
from llama_chat.storage.codec import compile_kernels as compile_codec

compile_kernels()
compile_long_prompts("mixed")  # (both: the crossover to BLAS, quantizing on the threads)
compile_codec()
"""


# `-n auto`: a worker's peak memory with the processes its tests start (the real-model tests' worker holds
# both real models: test_real_models.py alone peaked at 2.5 GiB), and the most workers that help: most
# tests wait on the app or on `llama-chat` processes, so 4 fit 2 cores.
WORKER_GIB = 2.5
MOST_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: as many workers as the memory free now holds (a laptop of 8 GB: 2), MOST_WORKERS at most."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist reads it
    return max(1, min(MOST_WORKERS, int(_free_gib() // WORKER_GIB)))


def _free_gib() -> float:
    from llama_chat.inference.packed_file import available_memory

    available = available_memory()
    if available is None:  # no /proc (macOS): half of the memory
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    return available / 2**30


def _starts_workers(config) -> bool:
    """This process is pytest-xdist's controller and will start workers (`-n N`, N > 0)."""
    return bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_collection_finish(session):
    # What is in memory once the tests are collected (every module imported, every test item: some
    # 400,000 objects) lives to the end: frozen, no garbage collection walks it again. Textual makes
    # objects fast enough to run one every few seconds, and they took a sixth of the TUI tests' time.
    gc.collect()
    gc.freeze()


# Modules whose tests take seconds each, mostly waiting (on `llama-chat` processes they start one after
# another, or on the app): under xdist they start first, and the many quick tests fill in at the end.
SLOW_FIRST = ("test_sessions.py", "test_reliability.py", "test_tui.py", "test_tui_tools.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    # Under xdist the real-model tests run one after another on one worker, as without it: each worker
    # would load both real models (GBs of memory), and on a first run prepare them into the same entries
    # of the user's cache at once. The others of test_tokenizer.py read the vocab files: one worker too,
    # with test_chat_template's (marked there), so each file is read once (vocab_metadata). One mark per
    # test: xdist joins the names of all of a test's group marks into one group.
    for item in items:
        if item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.xdist_group("real_model"))
        elif item.path.name == "test_tokenizer.py":
            item.add_marker(pytest.mark.xdist_group("vocab"))
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path, monkeypatch):
    """No test reads or writes the user's cache, data, config, state or database."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("LLAMA_CHAT_DB", raising=False)


@pytest.fixture(autouse=True)
def engines_closed(monkeypatch):
    """Every chat engine a test makes (itself, or through `main()`, the app or a server) is closed after
    it, as a program ends: an engine's scheduler thread keeps it, its model and its KV pool alive until
    then (tens of MB on a tiny model, a GB on a real one), and a worker runs hundreds of tests."""
    from llama_chat.app.chat.engine import ChatEngine

    made = []
    init = ChatEngine.__init__

    @functools.wraps(init)  # its source stays the engine's (test_layers reads what __init__ sets)
    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ChatEngine, "__init__", tracked)
    yield
    for engine in made:
        engine.close()
    if made:
        gc.collect()  # a model's arrays are in reference cycles: free them now, not at some later collection


@functools.cache
def vocab_metadata(name: str) -> dict:
    """The metadata of one of llama.cpp's vocab-only test files, read once per process: GGUFReader takes
    seconds on a 150k-token vocab. The tests that read them are one xdist group ("vocab"), on one worker."""
    from llama_chat.inference.gguf_file import open_gguf, read_metadata

    return read_metadata(open_gguf(FIXTURES / "vocab" / f"ggml-vocab-{name}.gguf"))


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-models")
    return {arch: write_tiny_model(folder / f"tiny-{arch}.gguf", arch) for arch in ARCHS}


@pytest.fixture
def qwen2(tiny_model_paths) -> Path:
    return tiny_model_paths["qwen2"]


@pytest.fixture(params=ARCHS)
def tiny_model_path(request, tiny_model_paths) -> Path:
    return tiny_model_paths[request.param]


@contextlib.contextmanager
def real_cache():
    """Use the user's real cache: real models are assembled and prepared once, shared by every run."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(REAL_CACHE)
    try:
        yield
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old


def _real_model_path(name: str) -> Path:
    from llama_chat.inference.catalog import KNOWN_MODELS, ensure_model

    with real_cache():
        return ensure_model(KNOWN_MODELS[name])


@pytest.fixture(scope="session")
def qwen_model_path() -> Path:
    return _real_model_path("qwen2.5-coder-0.5b-instruct-q4_k_m")


@pytest.fixture(scope="session")
def gemma_model_path() -> Path:
    return _real_model_path("gemma-3-270m-q4_k_m")


class ForwardPasses(list):
    """The rows of every forward pass the model made, in order; each pass also waits `delay` seconds."""

    delay = 0.0


@pytest.fixture
def forward_passes(monkeypatch) -> ForwardPasses:
    """Every forward pass, whoever asks for it (the scheduler's prompt pieces and reply rows, the
    engine, a prefill): they all end in inference/forward.py's step or read_and_verify. Setting
    `.delay` makes each wait as a real model's matrix maths would (without holding the GIL)."""
    from llama_chat.inference import forward

    seen = ForwardPasses()

    def watched(real, rows):
        @functools.wraps(real)
        def run(*args, **kwargs):
            seen.append(rows(*args))
            time.sleep(seen.delay)
            return real(*args, **kwargs)

        return run

    def batch_rows(batch, *_):
        return sum(len(tokens) for _, tokens in batch)

    monkeypatch.setattr(forward, "step", watched(forward.step, batch_rows))
    monkeypatch.setattr(
        forward,
        "read_and_verify",
        watched(forward.read_and_verify, lambda a, b, *_: batch_rows(a) + batch_rows(b)),
    )
    return seen


@pytest.fixture
def open_chat(tmp_path, tiny_model_paths):
    """The chat app, run headless: `async with open_chat(**settings) as pilot:` (see tui_pilot.py).
    `model`: another model file; `app`: an app made by the test; `wait=False`: start at once."""
    from tui_pilot import chat_app, opened

    def open_(model: Path | None = None, app=None, wait: bool = True, size=None, **settings):
        app = app or chat_app(tmp_path, model or tiny_model_paths["qwen2"], **settings)
        return opened(app, wait=wait, **({"size": size} if size else {}))

    return open_


@pytest.fixture
def served(tmp_path, qwen2):
    """A server on an ephemeral loopback port with the tiny Qwen2 model (tests/served.py)."""
    s = Served(tmp_path / "chat.db", qwen2).wait_ready()
    yield s
    s.stop()
