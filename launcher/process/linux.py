"""The two Linux process controls ftlaunch relies on, through prctl(2)."""

import ctypes
import ctypes.util
import os
import signal
from typing import Callable, Sequence

__all__ = ["become_subreaper", "die_with_parent", "ignoring", "set_parent_death_signal"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

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
