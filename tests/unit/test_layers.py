"""The import graph, read from the source: no circle between modules (lazy imports inside
functions included), worker_lib never imports the launcher, and the shared vocabulary never
imports the parts that use it (issue 21, item 2)."""

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
# The vocabulary: records and pure rules every part of the launcher shares.
_VOCABULARY = (
    "launcher.errors",
    "launcher.outcomes",
    "launcher.beats",
    "launcher.results",
    "launcher.durations",
    "launcher.config",
    "launcher.events",
    "launcher.failures",
    "launcher.stopping",
    "launcher.evidence",
    "launcher.policy",
    "launcher.group_state",
)
# What uses it: the loop, the roles, the attempt, the command line.
_USERS = ("launcher.supervisor", "launcher.attempt", "launcher.roles", "launcher.cli", "launcher.status_cli")


def _modules() -> Dict[str, Path]:
    found = {}
    for package in ("launcher", "worker_lib"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    imported.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle():
    assert _circles(_graph()) == []


def test_worker_lib_never_imports_the_launcher():
    graph = _graph()
    assert [
        (m, d) for m in graph if m.startswith("worker_lib") for d in graph[m] if d.startswith("launcher")
    ] == []


def test_the_vocabulary_never_imports_its_users():
    graph = _graph()
    upward = [
        (m, d)
        for m in _VOCABULARY
        for d in graph[m]
        if any(d == user or d.startswith(user + ".") for user in _USERS)
    ]
    assert upward == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


_FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def test_only_the_adapters_import_a_framework_and_nothing_imports_the_adapters():
    """``import worker_lib`` (or the launcher) never pays for, or needs, a framework."""
    for name, path in _modules().items():
        if name.startswith("worker_lib.integrations"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for imported in names:
                assert imported.split(".")[0] not in _FRAMEWORKS, f"{name} imports {imported}"
                assert not imported.startswith("worker_lib.integrations"), f"{name} imports {imported}"
