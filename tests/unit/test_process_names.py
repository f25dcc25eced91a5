"""The names processes are started by (``python -m NAME``) and found by (their titles in ps, the
fork server's file in a stack dump): each defined once, in ``launcher.forked.protocol`` and
``launcher.orphan_guard``, and right. A name that no longer fits its module would start nothing,
or the chaos scripts would look for what is not there and kill nothing (issue 49, item 4)."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from launcher.forked.protocol import SPARE_TITLE, STORE_HOST_TITLE, ZYGOTE_MODULE
from launcher.hangs.stacks import last_stacks
from launcher.orphan_guard import GUARD_MODULE

ROOT = Path(__file__).resolve().parents[2]
STARTED_BY = (ZYGOTE_MODULE, GUARD_MODULE)
NAMES = (*STARTED_BY, SPARE_TITLE, STORE_HOST_TITLE)
DEFINED_IN = {"launcher/forked/protocol.py", "launcher/orphan_guard/__init__.py"}
# Literals equal to a name that are not it: a thread of the follower's store client.
NOT_IT = {("launcher/cluster/deadline_store.py", STORE_HOST_TITLE)}


@pytest.mark.parametrize("name", STARTED_BY)
def test_each_module_a_process_is_started_by_is_there_and_runs_as_main(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"python -m {name}: no such module"
    assert spec.submodule_search_locations is None, f"{name} is a package: -m would run its __main__"
    assert 'if __name__ == "__main__":' in Path(spec.origin).read_text(), f"{name} does nothing as -m"


def test_a_dump_of_a_forked_worker_is_read_past_the_fork_servers_frames(tmp_path):
    """The stack reader finds the fork server by its file, named from ZYGOTE_MODULE."""
    frame = f'  File "{importlib.util.find_spec(ZYGOTE_MODULE).origin}", line 506 in main\n'
    log = tmp_path / "rank_0.log"
    script = '  File "/w/train.py", line 3 in <module>\n'
    log.write_text("Current thread 0x00000000000000bb (most recent call first):\n" + script + frame)
    assert last_stacks(log)[0xBB] == (script.strip(),)


def _literals(source: str):
    """The string constants of a module, its docstrings left out (prose may name a process), and
    the imports in scripts it writes left out too (a moved module fails those loudly)."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield re.sub(r"\b(?:from|import) [\w.]+", "", node.value)


def test_no_name_is_written_twice():
    """The launcher, the scripts (the chaos matrices) and the tests import each name; a copy of
    one (even inside a longer string) is what a move would leave behind."""
    copies = []
    for folder in ("launcher", "worker_lib", "scripts", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            source = path.read_text()
            if where in DEFINED_IN or not any(name in source for name in NAMES):
                continue
            for text in _literals(source):
                if (where, text) not in NOT_IT:
                    copies += [f"{where}: {text!r}" for name in NAMES if name in text]
    assert copies == []
