"""The import graph of sdk/, trainer/ and export/ (ARCHITECTURE.md §2), read from the source with ``ast``.

- No cycle between files, counting every import (module level and inside functions), nor between
  the sub-packages of a folder (``trainer.routers``, ``trainer.federated``, ...).
- Between folders only ``export -> trainer -> sdk`` (and ``export -> sdk``); the console-script
  module (``trainer/cli.py``, the ``fedroute`` entry point) may import all three, and nothing
  imports it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sdk", "trainer", "export")
CONSOLE_SCRIPT = "trainer.cli"
#: folder -> folders it may import
ALLOWED = {"sdk": {"sdk"}, "trainer": {"trainer", "sdk"}, "export": {"export", "trainer", "sdk"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache  # read once per setting: the tests below only read it
def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> our modules it imports (``from pkg import mod`` resolves to ``pkg.mod`` when that is
    a module; imports under ``if TYPE_CHECKING:`` only when ``type_checking``)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set()
        for node in ast.walk(tree):
            if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for n in ast.walk(node))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reader_resolves_imports():
    graph = import_graph()
    assert "sdk.kinds" in graph["sdk.router"] and "sdk.errors" in graph["sdk.kinds"]
    assert "export.kinds" in graph["export.publish"] and "trainer.server.errors" in graph["export.publish"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_files():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_files_counting_type_checking_imports():
    """A cycle under ``if TYPE_CHECKING:`` never runs, but it still ties the modules together (a type
    checker, and the reader, must load both): none either."""
    assert cycles(import_graph(type_checking=True)) == []


def test_no_import_cycle_between_sub_packages():
    """e.g. trainer.routers and trainer.federated: federated training uses the routers, not back."""
    def package(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for mod, deps in import_graph().items():
        graph.setdefault(package(mod), set()).update(package(d) for d in deps if package(d) != package(mod))
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    assert cycles(graph) == []


def test_folders_import_one_way_export_trainer_sdk():
    graph = import_graph()
    wrong = sorted((mod, dep) for mod, deps in graph.items() for dep in deps
                   if mod != CONSOLE_SCRIPT and dep.split(".")[0] not in ALLOWED[mod.split(".")[0]])
    assert wrong == []
    assert [m for m, deps in graph.items() if CONSOLE_SCRIPT in deps] == []  # nothing imports the top


def uncommented_function_level_imports() -> list[str]:
    """``path:line`` of each import inside a function with no comment saying why. A run of imports on
    consecutive lines shares one comment: on any of its lines, or on the line right above it."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            text = path.read_text()
            lines, tree = text.splitlines(), ast.parse(text, str(path))
            skip = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    skip.update(id(n) for n in ast.walk(node))
            imports = sorted({(n.lineno, n.end_lineno) for fn in ast.walk(tree)
                              if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                              for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip})
            runs: list[list[tuple[int, int]]] = []
            for start, end in imports:
                if runs and start == runs[-1][-1][1] + 1:
                    runs[-1].append((start, end))
                else:
                    runs.append([(start, end)])
            for run in runs:
                first, last = run[0][0], run[-1][1]
                said = any("#" in line for line in lines[first - 1:last]) or lines[first - 2].strip().startswith("#")
                if not said:
                    found.extend(f"{path.relative_to(ROOT)}:{start}" for start, _ in run)
    return found


def test_function_level_imports_say_why():
    """Imports inside functions are for optional heavy dependencies only (torch, transformers, the
    server extra, ...) and each run of them says so in a comment; the rest is imported at module level."""
    assert uncommented_function_level_imports() == []
