"""The package's import graph, read from the source with ast: no cycles, and arrows that point down only
(front ends → the chat layer → storage and inference; inference imports nothing above it)."""

from __future__ import annotations

import ast
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
    top_level = [n for n in commands.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("bench")]
    assert top_level == []  # imported inside cmd_bench, when the command runs
