"""The orphan guard: a tiny process that SIGKILLs the workers' process groups when the supervisor
dies. Workers get PR_SET_PDEATHSIG and die with the supervisor by themselves, but their own
children (DataLoader workers, compilers, shells) do not.

Its protocol: lines on its stdin, written by the supervisor (``launcher.process.orphan_guard``):
- ``+PGID`` as a group starts, ``-PGID`` as it ends;
- ``=PATH``: a folder to remove at EOF, after the kills (the node's memory tier: gigabytes of
  /dev/shm that nobody else would free);
- EOF: the supervisor died, by any signal (the kernel closes the pipe), or ended. Every group
  still listed is killed, unless its number has passed to another process meanwhile.

Run as ``python -m launcher.orphan_guard.guard``; it imports nothing heavy (nor does this
package), so it starts in ~20 ms.
"""

__all__ = ["FORGET", "GUARD_MODULE", "REMOVE_AT_END", "WATCH"]

GUARD_MODULE = "launcher.orphan_guard.guard"  # what it is started by, and found by (chaos, tests)
WATCH, FORGET, REMOVE_AT_END = "+", "-", "="  # a line's first character
