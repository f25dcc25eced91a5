"""A forked worker's exit: what the interpreter's exit does, for the worker's own modules only.

A worker forked from the zygote shares the zygote's 2,000 modules (torch, DDP, worker_lib). The
interpreter's teardown frees every object of every module, and each refcount it writes copies a
page of the zygote's: measured on 2 cores, 0.4-0.6 s of CPU for each rank at each exit
(`scripts/bench_zygote.py`). ``leave`` does what that exit does, in its order (CPython 3.11's
``Py_RunMain`` and ``Py_FinalizeEx``), except tearing down what the zygote imported:

1. the exit status and message of ``sys.exit(code)``: None 0, an int its value (one past a C
   long: 255), anything else printed on stderr, 1;
2. non-daemon threads joined (``threading._shutdown``);
3. the atexit functions (logging's flush, multiprocessing's children, ``weakref.finalize``);
4. stdout and stderr flushed, whatever objects they are now;
5. the worker's own modules (imported after the fork, the script's ``__main__`` first among
   them) taken out of ``sys.modules`` and cleared, newest first, as the interpreter clears them,
   then a collection: what they held is freed as at a real exit (a file left open is flushed and
   closed, a ``zipfile`` writes its directory, a ``__del__`` runs). An object still held
   elsewhere (by a daemon thread, by the zygote's modules) stays, as it would;
6. stdout and stderr flushed again; a flush that fails makes the status 120;
7. ``os._exit``.

An exception raised in a step (a signal handler's ``sys.exit``, a KeyboardInterrupt while
threads are joined) is printed as the interpreter prints one it ignores, and the next step runs.
A KeyboardInterrupt out of the script itself is not handled here: the interpreter ends by SIGINT,
as a new one would.
"""

import gc
import os
import sys
import traceback
from typing import Dict, NoReturn

__all__ = ["leave", "remember_imported"]

_FLUSH_FAILED = 120  # Py_RunMain's status when the final flush fails
_C_LONG = 1 << 63

# The zygote's modules, as it had them when it froze: everything else is the worker's own.
_IMPORTED: Dict[str, object] = {}


def remember_imported() -> None:
    """Called in the zygote once its imports are done, before any fork."""
    _IMPORTED.clear()
    _IMPORTED.update(sys.modules)


def leave(code: object) -> NoReturn:
    """End this forked worker as ``sys.exit(code)`` would end a new interpreter (module doc)."""
    import atexit
    import threading

    status = exit_status(code)
    if status is None:
        _say_message(code)
        status = 1
    _ignoring("threading", threading._shutdown)  # type: ignore[attr-defined]
    _ignoring("atexit", atexit._run_exitfuncs)
    if not _ignoring("the standard streams", _flush_standard):
        status = _FLUSH_FAILED
    _ignoring("the worker's modules", _clear_own_modules)
    if not _ignoring("the standard streams", _flush_standard):
        status = _FLUSH_FAILED
    os._exit(status)


def exit_status(code: object) -> "int | None":
    """The process status for ``sys.exit(code)``; None for a message (printed, then 1)."""
    if code is None:
        return 0
    if isinstance(code, int):  # bool too; past a C long the interpreter's conversion gives -1
        return (code if -_C_LONG <= code < _C_LONG else -1) & 0xFF
    return None


def _say_message(code: object) -> None:
    """As the interpreter prints a SystemExit's message: its str, then a newline (a str that
    raises prints the newline alone)."""
    stream = sys.stderr
    try:
        stream.write(str(code))
    except BaseException:  # noqa: BLE001 - as the interpreter: the error is cleared
        pass
    try:
        stream.write("\n")
        stream.flush()
    except BaseException:  # noqa: BLE001
        pass


def _flush_standard() -> None:
    """stdout, then stderr, each unless it is None or closed; raises if either flush failed."""
    failed = None
    for stream in (sys.stdout, sys.stderr):
        if stream is None or getattr(stream, "closed", True):
            continue
        try:
            stream.flush()
        except Exception as err:  # noqa: BLE001 - the other stream is flushed still
            failed = failed or err
    if failed is not None:
        raise failed


def _clear_own_modules() -> None:
    """The worker's own modules out of ``sys.modules``, then each one's names set to None, newest
    first, then a collection: what they alone held is freed."""
    _clear(_take_own_modules())
    gc.collect()


def _take_own_modules() -> list:
    own = [(name, module) for name, module in sys.modules.items() if _IMPORTED.get(name) is not module]
    for name, _module in own:
        del sys.modules[name]
    return [module for _name, module in reversed(own)]


def _clear(modules: list) -> None:
    """As ``_PyModule_ClearDict``: the names with one leading underscore set to None first, then
    every other one but ``__builtins__``."""
    while modules:
        namespace = getattr(modules.pop(0), "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for private in (True, False):
            for key in list(namespace):
                if key != "__builtins__" and (key.startswith("_") and not key.startswith("__")) == private:
                    namespace[key] = None


def _ignoring(where: str, step) -> bool:
    """Run ``step``; an exception it raises is printed as one the interpreter ignores at exit.
    Returns whether it ran to its end."""
    try:
        step()
        return True
    except BaseException:  # noqa: BLE001 - a signal's SystemExit included: the exit goes on
        try:
            print(f"Exception ignored in: {where}", file=sys.stderr)
            traceback.print_exc()
        except BaseException:  # noqa: BLE001 - no stderr left to say it on
            pass
        return False
