"""The package's import graph, read from the source with ast: no cycles, and arrows that point down only
(front ends → the chat layer → storage and inference; inference imports nothing above it)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the checkout's folders and the packages they install as (pyproject.toml's package-dir)
FOLDERS = {"package": "llama_chat", "app": "llama_chat.app", "inference": "llama_chat.inference"}
FOLDERS |= {"storage": "llama_chat.storage"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: its dotted name → (file, whether it is a package's __init__)."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = (path, path.name == "__init__.py")
    return found


def imported(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, at its top or inside a function alike: an import
    run late is still an arrow. `from . import x` is an arrow to module x; an arrow to a package that
    holds `name` is left out (Python initialises it first whoever imports what)."""
    here = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                targets.add(child if child in known else base)
    return {t for t in targets if t in known and t != name and not name.startswith(t + ".")}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, is_pkg, set(found)) for name, (path, is_pkg) in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            cycle = visit(nxt, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_no_module_of_the_package_imports_itself_through_others():
    graph = import_graph()
    assert "llama_chat.app.cli" in graph and "llama_chat.app.commands" in graph  # the walk sees the app
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_arrows_point_down_only():
    below = {
        "llama_chat.inference": ("llama_chat.app", "llama_chat.storage"),
        "llama_chat.storage": ("llama_chat.app",),
        "llama_chat.app.chat": tuple(
            n for n in modules() if n.startswith("llama_chat.app.") and ".chat" not in n
        ),
    }
    wrong = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        for layer, above in below.items()
        if name == layer or name.startswith(layer + ".")
        for target in targets
        if any(target == a or target.startswith(a + ".") for a in above)
    ]
    assert wrong == []


def test_the_chat_layer_imports_no_ui_code():
    ui = ("textual", "rich", "curses", "readline", "http", "starlette", "uvicorn")
    for path in (ROOT / "app" / "chat").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n.split(".")[0] in ui], f"{path.name} imports {names}"


# every module of the app but the chat layer's: the TUI, the command line (with chat_lines.py), the
# server, `bench`
FRONT_END_FOLDER, CHAT_LAYER = ROOT / "app", ROOT / "app" / "chat"
# what only the chat layer does: make and schedule jobs, and the KV steps its verbs order and lock
CHAT_INTERNALS = {"Job", "Scheduler", "scheduler", "lock", "live"}
KV_STEPS = {"hold", "store_kv", "restore_tail", "read_remote", "prefetch", "stored_ids", "snapshot"}
# what the engine keeps to itself: its store, model, session cache, scheduler and lock
ENGINE_STATE = {"store", "model", "kv", "live", "lock", "scheduler", "cache", "conversations"}


def front_end_files() -> list[Path]:
    return sorted(p for p in FRONT_END_FOLDER.rglob("*.py") if CHAT_LAYER not in p.parents)


def engine_surface() -> set[str]:
    """What a front end may use of the chat engine: its public methods and properties, and the public
    attributes its __init__ sets (plain facts: the context's size, the model's name and tokenizer, …)."""
    from llama_chat.app.chat.engine import ChatEngine

    init = ast.parse(textwrap.dedent(inspect.getsource(ChatEngine.__init__)))
    set_there = {
        node.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and ast.unparse(node.value) == "self"
    }
    return {name for name in {*vars(ChatEngine), *set_there} if not name.startswith("_")}


def is_engine(node: ast.expr) -> bool:
    """Whether an expression is (by its name) the chat engine: engine, self.engine, state.ready(), …"""
    text = ast.unparse(node)
    return text.split(".")[-1] in ("engine", "ready()")


def chat_internals_used(path: Path, surface: set[str] | None = None) -> list[str]:
    """What a front end's module imports of the chat layer's jobs and scheduler, and the KV steps and
    engine internals (its lock, its open sessions, its scheduler) it reaches for; and what it reads or
    writes of an engine beyond its `surface` (the engine's own: engine_surface()), such as its store."""
    surface = engine_surface() if surface is None else surface
    used = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.endswith(".chat.scheduler") for a in node.names):
            used.append("imports the scheduler")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in ("jobs", "scheduler"):
            used += [f"imports {a.name}" for a in node.names if a.name in CHAT_INTERNALS]
            used += ["imports the scheduler"] if node.module.endswith("scheduler") else []
        elif isinstance(node, ast.Attribute) and node.attr in KV_STEPS:
            used.append(f"calls {node.attr}")
        elif isinstance(node, ast.Attribute) and is_engine(node.value) and node.attr not in surface:
            used.append(f"reaches {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in CHAT_INTERNALS
            and "engine" in ast.unparse(node.value)
        ):
            used.append(f"reaches {ast.unparse(node)}")
    return used


def test_front_ends_speak_only_the_engines_verbs():
    files = front_end_files()
    names = {str(f.relative_to(ROOT)) for f in files}
    assert names >= {"app/cli.py", "app/commands.py", "app/chat_lines.py", "app/tui/chat_screen.py"}
    assert names >= {"app/serve/completions.py", "app/bench/stored.py"}
    wrong = {str(f.relative_to(ROOT)): chat_internals_used(f) for f in files}
    # `bench` times the scheduler itself, on jobs of its own and no engine
    assert wrong.pop("app/bench/forward.py") == ["imports Job", "imports Scheduler", "imports the scheduler"]
    assert {name: used for name, used in wrong.items() if used} == {}


def test_the_check_of_front_ends_sees_what_it_forbids(tmp_path):
    sample = tmp_path / "front.py"
    sample.write_text(
        "from ..chat.jobs import Job, stream_text\nfrom ..chat.scheduler import QueueFull\n"
        "def f(engine, seq, state, self):\n    with engine.lock:\n        engine.live.prefetch(seq)\n"
        "    engine.store.add_message('s', 'tool', 'answer')\n    state.ready()._model.forward([1], seq)\n"
        "    self.screen.engine._cache = None\n    engine.reply(seq, 'hi')\n"
    )
    surface = {"reply"}
    assert sorted(chat_internals_used(sample, surface)) == [
        "calls prefetch", "imports Job", "imports the scheduler", "reaches engine.live",
        "reaches engine.lock", "reaches engine.store", "reaches self.screen.engine._cache",
        "reaches state.ready()._model",
    ]  # fmt: skip


def test_the_engine_keeps_its_state_to_itself():
    assert engine_surface() & ENGINE_STATE == set()
    assert {"reply", "answer_tool", "new_session", "model_info", "n_ctx"} <= engine_surface()


STORE_INTERNALS = ("llama_chat.storage.exchange", "llama_chat.storage.transcript", "llama_chat.storage.store")


def store_opened(path: Path, name: str | None = None) -> list[str]:
    """Where a front end's module (`name`: its dotted name, else found from its place) opens the store
    itself or imports what only the sessions service (app/chat/sessions.py) uses: the store's module,
    export and import files, transcripts."""
    name = name or ".".join(["llama_chat", *path.relative_to(ROOT).with_suffix("").parts])
    targets = imported(name, path, False, set(modules()))
    found = [f"imports {t}" for t in targets if t.startswith(STORE_INTERNALS)]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "ChatStore":
            found.append("opens ChatStore")
    return found


def test_front_ends_reach_the_conversations_through_the_sessions_service(tmp_path):
    sample = tmp_path / "front.py"  # first, that the check sees what it forbids
    sample.write_text("from llama_chat.storage.exchange import export_session\nstore = ChatStore('x.db')\n")
    assert sorted(store_opened(sample, "llama_chat.app.tui.front")) == [
        "imports llama_chat.storage.exchange", "opens ChatStore"
    ]
    wrong = {str(f.relative_to(ROOT)): store_opened(f) for f in front_end_files()}
    # `bench` measures the store itself: what a session takes in it, a file's
    wrong.pop("app/bench/stored.py")
    assert {name: found for name, found in wrong.items() if found} == {}


def test_the_chat_engine_has_a_dozen_verbs_at_most():
    from llama_chat.app.chat.engine import ChatEngine

    verbs = [
        name for name, value in vars(ChatEngine).items() if callable(value) and not name.startswith("_")
    ]
    assert set(verbs) >= {"reply", "regenerate", "edit", "fork", "delete", "resume", "close", "answer_tool"}
    assert len(verbs) <= 12, verbs


def test_only_the_bench_command_imports_the_measurements():
    """The measurement code ships for `llama-chat bench` alone: no other module of the product loads it."""
    graph = import_graph()
    assert "llama_chat.app.bench.run" in graph  # the walk sees the bench package
    users = {
        name
        for name, targets in graph.items()
        if not name.startswith("llama_chat.app.bench")
        and any(t == "llama_chat.app.bench" or t.startswith("llama_chat.app.bench.") for t in targets)
    }
    assert users == {"llama_chat.app.commands"}
    commands = ast.parse((ROOT / "app" / "commands.py").read_text(encoding="utf-8"))
    top_level = [
        n for n in commands.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("bench")
    ]
    assert top_level == []  # imported inside cmd_bench, when the command runs
