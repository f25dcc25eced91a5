"""The import graph, read from the source: no circle between modules (lazy imports inside
functions included), and between packages every import runs down the layers (issue 35, item 1):
worker_lib never imports the launcher, the shared vocabulary (``launcher.core``) imports only the
grammar leaf below it, and the hang monitor decides while the process layer acts."""

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
# Every package of launcher/ and worker_lib/, lowest first. A package imports only packages of the
# layers below its own (siblings in one layer do not import each other). A package missing here
# fails the test: a new one is placed on purpose.
_LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("worker_lib.core",),  # what every part of the workers' library stands on: the contract, storage
    ("worker_lib.checkpoint",),  # checkpoints by concern: formats, tiers, staging, commit, retention
    ("worker_lib",),  # the public API (import worker_lib as ft) and the session
    ("worker_lib.integrations",),  # framework adapters (nothing imports them)
    ("launcher.grammar",),  # what a user may write, and the errors that refuse it
    ("launcher.core",),  # the vocabulary: configuration, events, outcomes, failures, policy
    # what runs in other processes: the fork server and what it forks (with Linux's process
    # controls, both sides'), the orphan guard (with its protocol)
    ("launcher.forked", "launcher.orphan_guard"),
    ("launcher.process",),  # the supervisor's process mechanics: spawn, signal, stop, logs, its ends
    # the mechanisms of one node's watch and of many nodes' meeting
    (
        "launcher.runs",
        "launcher.observe",
        "launcher.hangs",
        "launcher.chaos",
        "launcher.cluster",
        "launcher.replicas",
    ),
    ("launcher.roles",),  # single node, node 0, follower: what the loop and the attempt ask of each
    ("launcher.agent",),  # one node's supervisor: its parts from the sections, the loop, the attempt
    ("launcher",),  # the console line
    ("launcher.cli",),  # the command line: options -> sections, status, exit codes
    ("launcher.__main__",),  # python -m launcher and the ftlaunch script: the entry point
)


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


def _package(module: str, modules: Dict[str, Path]) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, and for the entry
    point (``__main__``), which stands above the package it is run as."""
    if modules[module].name in ("__init__.py", "__main__.py"):
        return module
    return module.rpartition(".")[0]


def _package_graph() -> Dict[str, Set[str]]:
    modules, graph = _modules(), _graph()
    packages: Dict[str, Set[str]] = {_package(m, modules): set() for m in modules}
    for module, imported in graph.items():
        mine = _package(module, modules)
        packages[mine].update(p for p in (_package(d, modules) for d in imported) if p != mine)
    return packages


def test_every_package_has_a_layer():
    placed = [p for layer in _LAYERS for p in layer]
    assert sorted(placed) == sorted(_package_graph()), "place a new package in _LAYERS"


def test_every_import_between_packages_runs_down_the_layers():
    height = {p: i for i, layer in enumerate(_LAYERS) for p in layer}
    graph, modules = _graph(), _modules()
    upward = [
        f"{m} imports {d}"
        for m in sorted(graph)
        for d in sorted(graph[m])
        if _package(m, modules) != _package(d, modules)
        and height[_package(d, modules)] >= height[_package(m, modules)]
    ]
    assert upward == []


def test_no_package_imports_itself_round_a_circle():
    assert _circles(_package_graph()) == []


def test_the_hang_monitor_decides_and_the_process_layer_acts():
    """launcher.hangs reads beats and names hung ranks; it never signals, sleeps on or imports the
    process layer (attempt.py hands its decision to ``WorkerGroup.dump_stacks``)."""
    packages = _package_graph()
    assert "launcher.process" not in packages["launcher.hangs"]
    for path in (ROOT / "launcher" / "hangs").glob("*.py"):
        assert "os.kill" not in path.read_text() and "time.sleep" not in path.read_text(), path


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


def test_no_class_is_over_250_lines():
    """From its ``class`` line to its last (issue 35, item 5): a class that grows past it holds
    more than one concern (CheckpointManager gave its reads and writes to PartReader and
    PartWriter; AttemptRunner its stops to GroupStop)."""
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


# Where the whole configuration may be handed: the command line that builds it, and the agent's
# entry that turns it into sections (issue 49, item 1). Every part below takes its own sections.
_TAKE_THE_WHOLE_CONFIG = (
    "launcher.cli",
    "launcher.agent.supervise",
    "launcher.agent.parts",
)


def test_below_the_agents_entry_no_function_takes_the_whole_config():
    takers = []
    for name, path in _modules().items():
        if name.startswith(_TAKE_THE_WHOLE_CONFIG):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(
                    a.annotation is not None and "LaunchConfig" in ast.unparse(a.annotation)
                    for a in arguments
                ):
                    takers.append(f"{name}.{node.name}")
    assert takers == []


def test_the_loop_and_the_attempt_ask_two_interfaces_with_nothing_in_common():
    from launcher.roles.link import PeerLink
    from launcher.roles.role import NodeRole

    def asked(cls: type) -> Set[str]:
        return {n for n in vars(cls) if not n.startswith("_")}

    assert asked(NodeRole) & asked(PeerLink) == set()
    assert {"meet", "conclude", "decide", "announce", "pause"} <= asked(NodeRole)
    assert {"interrupt", "tick", "agree_stop_step", "keep_alive", "publish_progress"} <= asked(PeerLink)
