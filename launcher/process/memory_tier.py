"""The node's memory tier: the folder in /dev/shm where this supervisor's workers keep their
memory snapshots (worker_lib.checkpoint.memory). It is the supervisor's, not a worker's: made when the
supervisor starts, removed when it ends, and by its orphan guard when it is killed; a later
supervisor on the node removes any that no live supervisor holds (the guard killed too:
launcher.core.owned, whose lock holds across PID namespaces)."""

import os
import shutil
from pathlib import Path
from typing import Optional

from launcher.core.owned import owned_folder, remove_unowned

__all__ = ["MemoryTier"]

_KIND = "ftlaunch-memory-"  # then owned-, the supervisor's pid and a random suffix
_SHM = Path("/dev/shm")


class MemoryTier:
    """``folder`` is None where the node has no writable /dev/shm: then there is no memory tier
    (a worker's ``to="memory"`` says so), never a disk pretending to be memory."""

    def __init__(self, shm: Path = _SHM) -> None:
        self.folder: Optional[Path] = None
        self._lock = -1  # the fd whose flock says the folder is in use, while it exists
        if not os.access(shm, os.W_OK):
            return
        remove_unowned(shm, _KIND)
        try:
            self._lock, self.folder = owned_folder(shm, _KIND)  # mode 0700
        except OSError:  # no room for even a folder: no memory tier, as without /dev/shm
            self.folder = None

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # still locked: no cleaner races it
            os.close(self._lock)
            self.folder = None
