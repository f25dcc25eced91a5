"""The supervisor's handle on the orphan guard (``launcher.orphan_guard``): start it, tell it each
group and folder, replace it when it dies."""

import subprocess
import sys
from typing import IO, List, Optional, Set

from launcher.forked.linux import ignoring
from launcher.orphan_guard import FORGET, GUARD_MODULE, REMOVE_AT_END, WATCH
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
            [sys.executable, "-m", GUARD_MODULE],
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
            self._send(f"{WATCH}{pgid}\n")
        for folder in self._folders:
            self._send(f"{REMOVE_AT_END}{folder}\n")
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
        self._send(f"{WATCH}{pgid}\n")

    def remove_at_end(self, folder: str) -> None:
        """The guard removes ``folder`` when this supervisor ends, however it ends."""
        self._folders.append(folder)
        self._send(f"{REMOVE_AT_END}{folder}\n")

    def forget(self, pgid: int) -> None:
        self._watched.discard(pgid)
        self._send(f"{FORGET}{pgid}\n")

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
