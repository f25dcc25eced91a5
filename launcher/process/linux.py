"""The Linux process controls ftlaunch relies on: prctl(2), and what a process shows of itself."""

import ctypes
import ctypes.util
import os
import signal
from typing import Callable, Sequence

__all__ = ["become_subreaper", "die_with_parent", "ignoring", "set_parent_death_signal", "show_as"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
# /proc/PID/stat's fields (counted from 1) that bound the command line and the environment.
_ARG_START, _ENV_END = 48, 51

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def become_subreaper() -> None:
    """Orphaned descendants (a DataLoader worker whose rank died) are re-parented to us, not
    to init, so the supervisor can still find, kill and reap every process it caused."""
    if _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def set_parent_death_signal(sig: int) -> None:
    """This process receives ``sig`` when its parent dies (see ``die_with_parent``)."""
    _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def ignoring(signals: Sequence[int]) -> Callable[[], None]:
    """A ``preexec_fn`` that sets ``signals`` to SIG_IGN, which survives exec: SLURM sends its
    preemption notice to every process of the step, and one a worker never asked for must not
    kill it (a script that installs its own handler still gets it)."""

    def _in_child() -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    return _in_child


def die_with_parent(sig: int = signal.SIGKILL, ignore: Sequence[int] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies, even by
    SIGKILL, and ignore the signals in ``ignore``. Everything is prepared here, before the fork,
    so the child only calls prctl and sets dispositions.

    The kernel fires it when the *thread* that forked the child exits: spawn from the
    supervisor's main thread only.
    """
    parent = os.getpid()
    ignore_them = ignoring(ignore)

    def _in_child() -> None:
        ignore_them()
        _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return _in_child


def show_as(name: str, argv: Sequence[str], environ: Sequence[str]) -> None:
    """What ps, top and /proc/PID/{comm,cmdline,environ} show of this process: a worker forked
    from the fork server looks like the script it runs, with its rank's variables, not like the
    fork server. The command line and the environment are written over the memory the kernel
    shows them from (as setproctitle does), each cut at a whole entry to the room it has;
    ``environ``: ``KEY=VALUE`` entries, those to keep first. Cosmetic: where the kernel refuses
    (a hardened /proc), nothing changes."""
    buffer = ctypes.create_string_buffer(name.encode()[:15])
    _prctl(_PR_SET_NAME, ctypes.cast(buffer, ctypes.c_void_p).value or 0, 0, 0, 0)
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        # fields[0] is field 3 (the state): field N is fields[N - 3]
        arg_start, arg_end, env_start, env_end = (int(f) for f in fields[_ARG_START - 3 : _ENV_END - 2])
        with open("/proc/self/mem", "r+b", buffering=0) as memory:
            for start, end, entries in ((arg_start, arg_end, argv), (env_start, env_end, environ)):
                memory.seek(start)
                memory.write(_fitted(entries, end - start))
    except (OSError, ValueError, IndexError):
        pass


def _fitted(entries: Sequence[str], room: int) -> bytes:
    """NUL-terminated entries, as many whole ones as fit in ``room`` bytes, NUL-padded to it."""
    data = b""
    for entry in entries:
        piece = entry.encode(errors="replace") + b"\0"
        if len(data) + len(piece) > room:
            break
        data += piece
    return data.ljust(room, b"\0")
