"""A tiny helper process that SIGKILLs the workers' process groups when the supervisor dies.

Workers get PR_SET_PDEATHSIG and die with the supervisor by themselves, but their own children
(DataLoader workers, compilers, shells) do not. The supervisor writes "+PGID" / "-PGID" lines to
this guard's stdin as groups start and end; when the supervisor dies, by any signal, the kernel
closes that pipe, the guard reads EOF and kills every group still listed, unless its number has
passed to another process meanwhile. A "=PATH" line names a folder the guard removes at EOF, after
the kills (the node's memory tier: gigabytes of /dev/shm that nobody else would free).

Run as ``python -m launcher.process.orphan_guard``; it imports nothing heavy, so it starts in ~20 ms.
"""

import os
import shutil
import signal
import subprocess
import sys
from typing import IO, Dict, List, Optional, Set

from launcher.forked.linux import ignoring
from launcher.process.signals import NOTICE_SIGNALS

__all__ = ["OrphanGuard"]


class OrphanGuard:
    """The supervisor's handle on the guard process."""

    def __init__(self) -> None:
        self._watched: Set[int] = set()
        self._folders: List[str] = []
        self._proc, self._pipe = self._start()

    @staticmethod
    def _start() -> "tuple[subprocess.Popen, Optional[IO[bytes]]]":
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.process.orphan_guard"],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a Ctrl+C in the terminal must not reach it
            preexec_fn=ignoring(NOTICE_SIGNALS),  # nor SLURM's preemption notice
        )
        return proc, proc.stdin

    def restart_if_dead(self) -> Optional[int]:
        """A guard that died (kill -9, the OOM killer) is replaced at once and told every group it
        watched: without it a dead supervisor would leave the workers' children running.
        Returns the dead guard's pid when it had to be replaced."""
        if self._proc.poll() is None:
            return None
        dead = self._proc.pid
        if self._pipe is not None:
            try:
                self._pipe.close()
            except BrokenPipeError:
                pass
        self._proc, self._pipe = self._start()
        for pgid in sorted(self._watched):
            self._send(f"+{pgid}\n")
        for folder in self._folders:
            self._send(f"={folder}\n")
        return dead

    def __enter__(self) -> "OrphanGuard":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pgid: int) -> None:
        self._watched.add(pgid)
        self._send(f"+{pgid}\n")

    def remove_at_end(self, folder: str) -> None:
        """The guard removes ``folder`` when this supervisor ends, however it ends."""
        self._folders.append(folder)
        self._send(f"={folder}\n")

    def forget(self, pgid: int) -> None:
        self._watched.discard(pgid)
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        """Normal shutdown: EOF with nothing listed makes the guard exit 0."""
        if self._pipe is not None:
            try:
                self._pipe.close()
            except BrokenPipeError:
                pass
            self._pipe = None
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _send(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            self._pipe.write(line.encode())
            self._pipe.flush()
        except BrokenPipeError:  # the guard died: restart_if_dead() replaces it
            self._pipe = None


def _guard(lines: IO[str]) -> int:
    # pgid → its leader's start time when the group was listed (None: the leader had gone)
    groups: Dict[int, Optional[str]] = {}
    folders: List[str] = []
    for line in lines:
        op, arg = line[:1], line[1:].rstrip("\n")
        if op == "=":
            folders.append(arg)
        elif op == "+":
            groups[int(arg)] = _started(int(arg))
        else:
            groups.pop(int(arg), None)
    for pgid, started in groups.items():
        if _reused(started, _started(pgid)):
            continue
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _reused(then: Optional[str], now: Optional[str]) -> bool:
    """Whether a listed group's number belongs to another process now: the kernel gives a pid
    out again only once no group uses it as its id, so a process with the group's number that
    is not the leader listed means the listed group is gone and the new owner is a stranger."""
    return now is not None and now != then


def _started(pid: int) -> Optional[str]:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field); None if no
    process has that pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(_guard(sys.stdin))
