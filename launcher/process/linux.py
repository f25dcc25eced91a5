"""The two Linux process controls ftlaunch relies on, through prctl(2)."""

import ctypes
import ctypes.util
import os
import signal
from typing import Callable

__all__ = ["become_subreaper", "die_with_parent"]

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


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies, even by
    SIGKILL. Everything is prepared here, before the fork, so the child only calls prctl.

    The kernel fires it when the *thread* that forked the child exits: spawn from the
    supervisor's main thread only.
    """
    parent = os.getpid()

    def _in_child() -> None:
        _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return _in_child
