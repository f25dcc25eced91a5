"""The orphan guard: a tiny process that SIGKILLs the workers' process groups when the supervisor
dies (PR_SET_PDEATHSIG kills the workers, not their children: DataLoader workers, shells).

Its protocol, lines on its stdin from the supervisor (``launcher.process.orphan_guard``):
``+PGID`` as a group starts, ``-PGID`` as it ends, ``=PATH`` a folder to remove after the kills
(the node's memory tier in /dev/shm). At EOF (the supervisor ended or died: the kernel closes the
pipe) it kills every group still listed, unless its number has passed to another process.

Run as ``python -m launcher.orphan_guard.guard``; nothing heavy is imported, so it starts in ~20 ms.
"""

__all__ = ["FORGET", "GUARD_MODULE", "REMOVE_AT_END", "WATCH"]

GUARD_MODULE = "launcher.orphan_guard.guard"  # what it is started by, and found by (chaos, tests)
WATCH, FORGET, REMOVE_AT_END = "+", "-", "="  # a line's first character
