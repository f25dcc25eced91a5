"""The supervisor's side of the heartbeat slots: one shared-memory file per attempt."""

import mmap
import os
import tempfile
from pathlib import Path
from typing import Dict, Tuple

import psutil

from launcher.core.beats import BeatReading, CheckpointCounters
from worker_lib.core import contract as c

__all__ = ["HeartbeatBoard"]


_PREFIX = "ftlaunch-heartbeat-"  # then the supervisor's pid, the attempt, a random suffix
_SHM = "/dev/shm"


def _remove_orphaned_boards(folder: str) -> None:
    """Files left by supervisors that were killed (SIGKILL gives no chance to clean up)."""
    for path in Path(folder).glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            path.unlink(missing_ok=True)


def _slot_file(prefix: str, size: int, folder: str) -> Tuple[int, str]:
    """A file of ``size`` zero bytes in ``folder``, its pages reserved: a file only truncated to
    its size has none, and the first store into a page that a full tmpfs cannot give is SIGBUS
    (the supervisor's, or a worker's at its first beat). Raises OSError, leaving nothing behind."""
    fd, name = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        os.posix_fallocate(fd, 0, size)  # zeros: no beat, no pause, nothing registered
    except OSError:
        os.close(fd)
        os.unlink(name)
        raise
    return fd, name


class HeartbeatBoard:
    """Creates the slot file for ``nproc`` local ranks; read by the supervisor, written by workers.

    In /dev/shm where there is one with room (memory, never written back to a disk), else in the
    temp dir; ``fallback`` then says why (one line), else it is empty.
    """

    def __init__(self, nproc: int, attempt: int, first_rank: int = 0, shm: str = _SHM) -> None:
        prefix, size = f"{_PREFIX}{os.getpid()}-{attempt}-", nproc * c.SLOT_WORDS * 8
        self.fallback = "" if os.access(shm, os.W_OK) else f"{shm} is not writable"
        if not self.fallback:
            _remove_orphaned_boards(shm)
            try:
                fd, name = _slot_file(prefix, size, shm)
            except OSError as err:
                self.fallback = f"{shm} has no room ({err.strerror or err})"
        if self.fallback:
            _remove_orphaned_boards(tempfile.gettempdir())
            fd, name = _slot_file(prefix, size, tempfile.gettempdir())
        self.path = Path(name)
        self._nproc = nproc
        self._first_rank = first_rank  # slot i is LOCAL_RANK i, global rank first_rank + i
        try:
            self._map = mmap.mmap(fd, 0)  # read and write: the supervisor writes SLOT_STOP_AT_STEP
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")

    def read(self) -> Dict[int, BeatReading]:
        """Every local rank's slot, by global rank."""
        readings = {}
        for index in range(self._nproc):
            w = self._words[index * c.SLOT_WORDS :][: c.SLOT_WORDS].tolist()
            readings[self._first_rank + index] = BeatReading(
                beats=w[c.SLOT_BEATS],
                step=w[c.SLOT_STEP],
                active_at=w[c.SLOT_TIME_NS] / 1e9,
                paused=w[c.SLOT_PAUSED] > 0,
                pauses=w[c.SLOT_PAUSES],
                dump_signal=w[c.SLOT_DUMP_SIGNAL],
                main_thread=w[c.SLOT_MAIN_THREAD],
                pid=w[c.SLOT_PID],
                loaded_at=w[c.SLOT_LOADED_NS] / 1e9,
                stop_aware=bool(w[c.SLOT_STOP_AWARE]),
                loaded_step=w[c.SLOT_LOADED_STEP] if w[c.SLOT_LOADED_TIER] else -1,
                loaded_tier=w[c.SLOT_LOADED_TIER],
            )
        return readings

    def checkpoint_counters(self) -> Dict[int, CheckpointCounters]:
        """Every local rank's checkpoint counters, by global rank."""
        counters = {}
        for index in range(self._nproc):
            w = self._words[index * c.SLOT_WORDS :][: c.SLOT_WORDS].tolist()
            counters[self._first_rank + index] = CheckpointCounters(
                saves_memory=w[c.SLOT_SAVES_MEMORY],
                save_memory_ns=w[c.SLOT_SAVE_MEMORY_NS],
                saves_storage=w[c.SLOT_SAVES_STORAGE],
                save_storage_ns=w[c.SLOT_SAVE_STORAGE_NS],
                commits=w[c.SLOT_COMMITS],
                commit_ns=w[c.SLOT_COMMIT_NS],
                load_ns=w[c.SLOT_LOAD_NS],
            )
        return counters

    def request_stop(self, at_step: int) -> None:
        """Ask every rank to stop once it reaches ``at_step`` (ft.should_stop)."""
        for rank in range(self._nproc):
            self._words[rank * c.SLOT_WORDS + c.SLOT_STOP_AT_STEP] = max(1, at_step)

    def request_chaos(self, rank: int, word: int) -> None:
        """Leave a --chaos request in global ``rank``'s slot, for worker_lib to carry out."""
        self._words[(rank - self._first_rank) * c.SLOT_WORDS + c.SLOT_CHAOS] = word

    def close(self) -> None:
        self._words.release()
        self._map.close()
        self.path.unlink(missing_ok=True)
