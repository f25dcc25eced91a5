"""Memory-tier slots mapped and registered with CUDA ahead by a warm spare (``look``), for the
worker it becomes (``take``): registering costs a fresh process 195 ms for 1.6 GB on an H200.
A buffer is handed over only for the same file (device, inode, size); a changed one is let go.
"""

import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from worker_lib.checkpoint.staging import HostBuffer

__all__ = ["forget", "held", "look", "take"]

_Key = Tuple[int, int, int]  # st_dev, st_ino, st_size
_held: Dict[str, Tuple[_Key, HostBuffer]] = {}  # data file's path → its mapping (this process's)


def look(folder: Path, rank: int, pin: bool, go_on: Callable[[], bool] = lambda: True) -> None:
    """Map each of ``rank``'s slot files in ``folder`` not mapped yet (registered when ``pin``);
    let go of any that changed or went. ``go_on`` is asked before each slot."""
    for slot in (0, 1):
        if not go_on():
            return
        path = str(folder / f"rank_{rank}.{slot}")
        key = _key(path)
        have = _held.get(path)
        if have is not None and have[0] == key:
            continue
        forget(path)
        if key is None:
            continue
        buffer = _map(path, key[2])
        if buffer is None:
            continue
        if pin and not buffer.pin():  # CUDA refused: a pageable mapping saves nothing
            buffer.close()
            continue
        _held[path] = (key, buffer)


def take(path: Path, size: int) -> Optional[HostBuffer]:
    """The buffer mapped ahead for ``path``, if it is still that file at ``size`` bytes: from now
    on the caller's (to close). Any other mapped for it is let go."""
    have = _held.pop(str(path), None)
    if have is None:
        return None
    key, buffer = have
    if key != _key(str(path)) or key[2] != size:
        buffer.close()
        return None
    return buffer


def forget(path: Optional[str] = None) -> None:
    """Let go of the mapping of ``path`` (every one when None)."""
    for name in [path] if path is not None else list(_held):
        have = _held.pop(name, None)
        if have is not None:
            have[1].close()


def held() -> Dict[str, bool]:
    """Path → registered with CUDA, of each mapping held in this process."""
    return {path: buffer.pinned for path, (_, buffer) in _held.items()}


def _key(path: str) -> Optional[_Key]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size) if st.st_size > 0 else None


def _map(path: str, size: int) -> Optional[HostBuffer]:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # removed since its stat: the next look sees it
        return None
    try:
        return HostBuffer(size, fd)
    except (OSError, ValueError):  # truncated between the stat and the map
        return None
    finally:
        os.close(fd)
