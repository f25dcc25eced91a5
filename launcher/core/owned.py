"""Files and folders that a supervisor keeps where other processes look (/dev/shm, the temp dir),
and the one rule by which a later ftlaunch removes those whose owner is dead.

The owner holds an ``flock`` on the item (a folder: its ``.owner`` file) for its whole life; the
kernel drops it when the owner dies, whatever PID namespace either side is in, and a reused pid
cannot fake it. A cleaner removes only what it can lock. A pid that does not exist here proves
nothing: in a container sharing /dev/shm (``docker --ipc=host``) the owner's pid is another
namespace's. Names read ``<kind>owned-<pid>-...``: an older ftlaunch's cleaner, which judged by a
pid in front, skips them; what such a one left (``<kind><pid>-...``, no lock) is kept, since
nothing shows whether its owner is alive, and named once in the log (--verbose): on a machine
where older ftlaunch runs live, a warning would come with every launch.

Where the owner's mark is a pid in a record (the run dir's lock, the lobby's claims), the pid
is asked only in the pid space that wrote it (``pid_space``), else the record's lease decides."""

import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Optional, Set, Tuple, Union

__all__ = ["owned_file", "owned_folder", "remove_unowned", "pid_space", "OWNER"]

log = logging.getLogger(__name__)

OWNER = ".owner"  # in an owned folder: the file its owner holds locked
_OWNED = "owned-"
_TRIES = 3  # a cleaner can take a new name only in its first microseconds: a retry is rare
_said: Set[str] = set()  # older ftlaunch's leftovers already named by this process
_HOST_PID_NS = 0xEFFFFFFC  # the kernel's PROC_PID_INIT_INO: the host's own PID namespace


def pid_space() -> str:
    """Where this process's pid means something: the host's name, and the PID namespace's number
    where it is not the host's own (a container's, ``unshare --pid``'s), as ``host/pidns-N``.
    A recorded pid is asked of the kernel only where this equals the record's; the host's own
    namespace keeps the bare name, which older ftlaunch records hold."""
    host = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: nothing to tell namespaces apart by
        return host
    return host if namespace == _HOST_PID_NS else f"{host}/pidns-{namespace}"


def owned_file(parent: Union[str, Path], kind: str, tag: str = "") -> Tuple[int, Path]:
    """A new empty file in ``parent``, named for ``kind`` (``ftlaunch-heartbeat-``) and ``tag``,
    and its fd, which holds the lock: keep it open for the file's life, unlink the file first."""
    for _ in range(_TRIES):
        fd, name = tempfile.mkstemp(prefix=_prefix(kind) + tag, dir=parent)  # 0600, not inherited
        if _hold(fd, name):
            return fd, Path(name)
        os.close(fd)  # a cleaner took it between the two calls, and removes it
    raise _lost(parent)


def owned_folder(parent: Union[str, Path], kind: str) -> Tuple[int, Path]:
    """A new folder (mode 0700) in ``parent``, named for ``kind``, and the fd of its ``.owner``
    file, which holds the lock: keep it open for the folder's life, remove the folder first."""
    for _ in range(_TRIES):
        folder = Path(tempfile.mkdtemp(prefix=_prefix(kind), dir=parent))
        fd = _lock(folder / OWNER, create=True)
        if fd is not None:
            return fd, folder
    raise _lost(parent)


def remove_unowned(parent: Union[str, Path], kind: str) -> None:
    """Remove ``kind``'s files and folders in ``parent`` that no live process holds."""
    older = []
    for path in Path(parent).glob(f"{kind}*"):
        tail = path.name[len(kind) :]
        if tail.startswith(_OWNED):
            _remove_if_unheld(path)
        elif tail.split("-", 1)[0].isdigit() and str(path) not in _said:
            older.append(str(path))
    if older:
        _said.update(older)
        shown = ", ".join(sorted(older)[:3]) + (f" and {len(older) - 3} more" if len(older) > 3 else "")
        log.info(
            "kept %s: an older ftlaunch's, with no owner lock (its owner may be alive in another "
            "PID namespace); remove by hand once no such run is on this machine",
            shown,
        )


def _prefix(kind: str) -> str:
    return f"{kind}{_OWNED}{os.getpid()}-"


def _remove_if_unheld(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):  # not made by ftlaunch: /dev/shm is everyone's
        return
    folder = stat.S_ISDIR(mode)
    # a folder in its first microseconds has no .owner yet: the cleaner makes it, to lock it
    fd = _lock(path / OWNER, create=True) if folder else _lock(path, create=False)
    if fd is None:
        return
    try:  # holding the lock: its owner, if it is still making it, sees it lost and takes another
        if folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _lock(path: Path, create: bool) -> Optional[int]:
    """An fd of ``path`` holding its lock; None where another holds it, or it cannot be opened
    (gone, its folder removed, another user's, a link): nothing to judge by."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    if _hold(fd, path):
        return fd
    os.close(fd)
    return None


def _hold(fd: int, path: Union[str, Path]) -> bool:
    """Lock ``fd`` without waiting, and check that ``path`` still names its file: a cleaner may
    have locked and removed it between the open and the lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        now, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _lost(parent: Union[str, Path]) -> OSError:
    return OSError(errno.EAGAIN, f"each new name in {parent} was removed while it was made")
