"""A forked worker's exit (launcher/forked/worker_exit.py): the status the interpreter gives
``sys.exit(code)``, and its own modules cleared as the interpreter clears a module."""

import sys
import types

import pytest

from launcher.forked import worker_exit


@pytest.mark.parametrize(
    "code, status",
    [
        (None, 0),
        (0, 0),
        (7, 7),
        (True, 1),
        (256, 0),
        (-1, 255),
        (2**63 - 1, 255),
        (2**63, 255),
        (-(2**63) - 1, 255),
    ],
)
def test_the_status_of_an_exit_code_is_the_interpreters(code, status):
    assert worker_exit.exit_status(code) == status


@pytest.mark.parametrize("code", ["a message", 1.5, object()])
def test_an_exit_code_that_is_no_int_is_a_message_then_1(code):
    assert worker_exit.exit_status(code) is None


def test_a_module_is_cleared_private_names_first_and_its_builtins_kept():
    freed = []

    class Noted:
        def __init__(self, name):
            self.name = name

        def __del__(self):
            freed.append(self.name)

    module = types.ModuleType("worker_own")
    module.public, module._private, module.__dunder__ = (
        Noted("public"),
        Noted("_private"),
        Noted("__dunder__"),
    )
    module.__builtins__ = builtins = {"kept": True}
    worker_exit._clear([module])
    assert freed[0] == "_private" and sorted(freed[1:]) == ["__dunder__", "public"]
    assert module.__builtins__ is builtins and module.public is None


def test_only_the_modules_imported_after_the_zygote_froze_are_taken(monkeypatch):
    monkeypatch.setattr(worker_exit, "_IMPORTED", dict(sys.modules))
    mine = types.ModuleType("imported_by_the_worker")
    monkeypatch.setitem(sys.modules, "imported_by_the_worker", mine)
    replaced = types.ModuleType("__main__")  # the script's __main__ in place of the zygote's
    monkeypatch.setitem(sys.modules, "__main__", replaced)
    taken = worker_exit._take_own_modules()
    assert taken == [mine, replaced]  # newest first; __main__'s place is the zygote's, early
    assert "imported_by_the_worker" not in sys.modules and "__main__" not in sys.modules
