"""--chaos kill-node's mechanics: this supervisor and every process it started SIGKILLed at once, as
a machine's death takes them. Nothing stops in order and nothing cleans up (the orphan guard dies
with the rest); the memory tier in /dev/shm goes too, as the machine's memory would."""

import os
import signal
from typing import NoReturn, Set

from launcher.process.memory_tier import drop_own_tiers
from launcher.process.tree import descendants

__all__ = ["lose_this_node"]

_FREEZE_PASSES = 20  # a fork server forking at the moment needs two; more is a runaway


def lose_this_node() -> NoReturn:
    """Never returns: the caller's process is the last to die."""
    frozen = _freeze_tree()
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    drop_own_tiers()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(-signal.SIGKILL)  # unreachable: SIGKILL cannot be caught


def _freeze_tree() -> Set[int]:
    """Every descendant, SIGSTOPped until a walk finds none new: a stopped process forks no more,
    so none outlives the kill, and none sees another die first (the guard would clean up)."""
    frozen: Set[int] = set()
    for _ in range(_FREEZE_PASSES):
        new = [pid for pid in descendants() if pid not in frozen]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen.update(new)
    return frozen


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
