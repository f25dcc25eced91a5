"""The node's memory tier: the folder in /dev/shm where this supervisor's workers keep their
memory snapshots (worker_lib.checkpoint.memory). It is the supervisor's, not a worker's: made when the
supervisor starts, removed when it ends, and by its orphan guard when it is killed; a later
supervisor on the node removes any left by one whose process is gone (the guard killed too)."""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import psutil

__all__ = ["MemoryTier"]

_PREFIX = "ftlaunch-memory-"  # then the supervisor's pid and a random suffix
_SHM = Path("/dev/shm")


class MemoryTier:
    """``folder`` is None where the node has no writable /dev/shm: then there is no memory tier
    (a worker's ``to="memory"`` says so), never a disk pretending to be memory."""

    def __init__(self, shm: Path = _SHM) -> None:
        self.folder: Optional[Path] = None
        if not os.access(shm, os.W_OK):
            return
        _remove_orphaned(shm)
        try:
            self.folder = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=shm))  # mode 0700
        except OSError:  # no room for even a folder: no memory tier, as without /dev/shm
            self.folder = None

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _remove_orphaned(shm: Path) -> None:
    for path in shm.glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
