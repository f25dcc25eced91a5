"""The supervisor's side of the heartbeat slots: one shared-memory file per attempt."""

import mmap
import os
import tempfile
from pathlib import Path
from typing import Dict, Tuple

from launcher.core.beats import BeatReading, CheckpointCounters, OwnWork
from launcher.core.owned import owned_file, remove_unowned
from worker_lib.core import contract as c

__all__ = ["HeartbeatBoard"]


# then owned-, the supervisor's pid, the attempt, a random suffix. Files a killed supervisor left
# (SIGKILL gives no chance to clean up) go when the next one makes its own (launcher.core.owned).
_KIND = "ftlaunch-heartbeat-"
_SHM = "/dev/shm"


def _slot_file(attempt: int, size: int, folder: str) -> Tuple[int, Path]:
    """A file of ``size`` zero bytes in ``folder``, its pages reserved (else a full tmpfs is a
    SIGBUS at the first store), its fd holding the owner's lock; OSError leaves nothing."""
    remove_unowned(folder, _KIND)
    fd, name = owned_file(folder, _KIND, tag=f"{attempt}-")
    try:
        os.posix_fallocate(fd, 0, size)  # zeros: no beat, no pause, nothing registered
    except OSError:
        name.unlink()
        os.close(fd)
        raise
    return fd, name


def _kind(index: int) -> str:
    return c.COLLECTIVE_KINDS[index] if 0 <= index < len(c.COLLECTIVE_KINDS) else "other"


class HeartbeatBoard:
    """The slot file for ``nproc`` local ranks, in /dev/shm where it has room, else in the temp
    dir (``fallback`` says why)."""

    def __init__(self, nproc: int, attempt: int, first_rank: int = 0, shm: str = _SHM) -> None:
        size = nproc * c.SLOT_WORDS * 8
        self.fallback = "" if os.access(shm, os.W_OK) else f"{shm} is not writable"
        if not self.fallback:
            try:
                fd, self.path = _slot_file(attempt, size, shm)
            except OSError as err:
                self.fallback = f"{shm} has no room ({err.strerror or err})"
        if self.fallback:
            fd, self.path = _slot_file(attempt, size, tempfile.gettempdir())
        self._lock = fd  # open for the file's life: its flock says the file is in use
        self._nproc = nproc
        self._first_rank = first_rank  # slot i is LOCAL_RANK i, global rank first_rank + i
        try:
            self._map = mmap.mmap(fd, 0)  # read and write: the supervisor writes SLOT_STOP_AT_STEP
        except BaseException:
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise
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
                # settled evidence only: a rank that just entered its collective may not show it yet
                collective=w[c.SLOT_COLLECTIVE_SEQ] if w[c.SLOT_COLLECTIVE_SAME] else -1,
                collective_kind=_kind(w[c.SLOT_COLLECTIVE_KIND]) if w[c.SLOT_COLLECTIVE_SAME] else "",
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

    def own_work(self) -> Dict[int, OwnWork]:
        """Every local rank's own-work counters, by global rank."""
        counters = {}
        for index in range(self._nproc):
            w = self._words[index * c.SLOT_WORDS :][: c.SLOT_WORDS].tolist()
            counters[self._first_rank + index] = OwnWork(
                w[c.SLOT_OWN_STEPS], w[c.SLOT_OWN_NS], w[c.SLOT_OWN_STEP_NS]
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
        self.path.unlink(missing_ok=True)  # still locked: no cleaner races it
        os.close(self._lock)
