"""Stopping process trees: a first signal + SIGCONT to every group and descendant, a grace
period on a monotonic clock, SIGKILL, then a psutil check that nothing is left.

The supervisor is a child subreaper (``linux.become_subreaper``), so a grandchild whose parent
died is re-parented to the supervisor and still found among its descendants here.
"""

import dataclasses
import os
import signal
import time
from typing import Callable, Collection, Iterable, List, Optional, Set

import psutil

__all__ = ["DescendantLook", "StopReport", "descendants", "last_pid", "stop_tree"]

_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class StopReport:
    killed: bool  # the grace period ran out (or was cut short) and SIGKILL was needed
    survivors: List[int]  # pids still alive afterwards (uninterruptible sleep, say)
    seconds: float


def descendants(exclude: Collection[int] = (), our_main_thread_only: bool = False) -> List[int]:
    """The pid of every descendant of this process, except ``exclude`` (the orphan guard, the
    spawner's helpers) and theirs (what the fork server is forking right now).
    Walked down from here through /proc/<pid>/task/<tid>/children, which reads only our own
    descendants' entries: psutil's children() reads every process of the machine (330 opens a
    second on a machine of 160 processes, for the look every half second at a healthy group).
    ``our_main_thread_only``: of this process's own threads, read the main thread's list alone
    (the supervisor forks from it only, and orphans are re-parented to it: the first live thread);
    its other threads (stores, liveness, the run dir) were 8 of the periodic look's 10 reads."""
    skip = frozenset(exclude)
    try:
        return _walk(os.getpid(), skip, our_main_thread_only)
    except OSError:  # a kernel without those files (CONFIG_PROC_CHILDREN): ask psutil
        try:
            return _psutil_walk(psutil.Process(), skip)
        except psutil.Error:
            return []


def _walk(root: int, skip: Collection[int], root_main_thread_only: bool = False) -> List[int]:
    """Descendants of ``root`` but ``skip`` and theirs, breadth first. OSError when the kernel has
    no children files; a process that is gone on the way is skipped with its subtree (its
    children are re-parented to us, the subreaper, and found at the next look)."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        raise OSError("no /proc/<pid>/task/<tid>/children")
    found, level = [], [root]
    while level:
        below = []
        for pid in level:
            try:
                only_main = pid == root and root_main_thread_only
                tids = [str(pid)] if only_main else os.listdir(f"/proc/{pid}/task")
            except (FileNotFoundError, ProcessLookupError):
                continue
            for tid in tids:  # a child belongs to the thread that forked it
                below += [c for c in _children_of(f"/proc/{pid}/task/{tid}/children") if c not in skip]
        found += below
        level = below
    return found


def last_pid() -> Optional[int]:
    """The pid the kernel handed out last in our pid namespace (to a process or a thread), or
    None where /proc/sys/kernel/ns_last_pid cannot be read."""
    try:
        fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class DescendantLook:
    """The descendants for a periodic look, walked again only when a pid was handed out since the
    last walk (``last_pid`` moved): no process can have joined our tree otherwise, and a healthy
    group's walk re-read every thread's children file twice a second. Between walks the caller
    gets the last walk's pids (some may be gone: it asks each one)."""

    def __init__(
        self, walk: Callable[[], List[int]], last_pid: Callable[[], Optional[int]] = last_pid
    ) -> None:
        self._walk, self._last_pid = walk, last_pid
        self._walked_at: Optional[int] = None  # last_pid() before the last walk
        self._found: List[int] = []

    def __call__(self) -> List[int]:
        now = self._last_pid()  # read before the walk: a fork during it moves it for the next look
        if now is None or now != self._walked_at:
            self._found = self._walk()
            self._walked_at = now
        return list(self._found)


def _psutil_walk(process: psutil.Process, skip: Collection[int]) -> List[int]:
    found = []
    for child in process.children():
        if child.pid not in skip:
            found.append(child.pid)
            try:
                found += _psutil_walk(child, skip)
            except psutil.Error:  # gone on the way: its children are ours now, found next time
                pass
    return found


def _children_of(path: str) -> List[int]:
    """The pids a thread's children file lists ([]: the thread is gone). Read with bare system
    calls: a worker may have a hundred threads, and Python's open() adds five calls to each file
    (fstat twice, lseek twice, ioctl), which made this walk cost twice psutil's at 100 threads a
    rank."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return []
    try:
        chunks = []
        while True:  # one read holds thousands of pids; a longer list comes in several
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    except ProcessLookupError:  # the thread exited between the open and the read
        return []
    finally:
        os.close(fd)
    return [int(pid) for pid in b"".join(chunks).split()]


def stop_tree(
    leaders: Collection[int],
    first_signal: int,
    grace: float,
    abort: Callable[[], bool],
    exclude: Callable[[], Collection[int]] = tuple,
    reap: Callable[[], object] = lambda: None,
    meanwhile: Callable[[], object] = lambda: None,
) -> StopReport:
    """Stop every process group led by ``leaders`` and every descendant of ours but ``exclude()``
    (asked before each round of signals: ``meanwhile`` may make helpers of the caller's).

    ``abort()`` turning true (a second Ctrl+C) ends the grace period at once; ``reap()`` lets
    the owner collect its children's exit statuses while we wait; ``meanwhile()`` runs once the
    first signal is sent, while the processes exit.
    """
    start = time.monotonic()
    # A stopped process acts on SIGTERM only once continued: the signal goes first, so that it is
    # already pending when SIGCONT resumes the process (continued first, a process that stops
    # itself again, in a loop or a chaos fault, would be stopped anew before SIGTERM came).
    targets = _signal_all(leaders, first_signal, exclude())
    targets |= _signal_all(leaders, signal.SIGCONT, exclude())
    meanwhile()
    deadline = start + grace
    pause = _Backoff()
    while _alive(targets) and time.monotonic() < deadline and not abort():
        reap()
        pause.sleep()
    killed = bool(_alive(targets))
    if killed:
        targets |= _signal_all(leaders, signal.SIGKILL, exclude())
    survivors = _wait_gone(targets, set(leaders), reap, timeout=2.0)
    return StopReport(killed=killed, survivors=survivors, seconds=time.monotonic() - start)


def _signal_all(leaders: Iterable[int], sig: int, exclude: Collection[int]) -> Set[int]:
    """Signal each group (catches processes born since the last look) and each descendant that
    left the groups; return the pids signalled. Each process gets the signal once: a script's
    SIGTERM handler that ran twice, nested, cut its own save short. A group is signalled only
    while one of our descendants is in it: a group whose last process is gone frees its number,
    and the kernel may give it to a stranger's new group."""
    groups_of = {}
    for pid in descendants(exclude):
        try:
            groups_of[pid] = os.getpgid(pid)
        except ProcessLookupError:
            continue
    groups = set(leaders) & set(groups_of.values())
    for pgid in groups:
        _quietly(os.killpg, pgid, sig)
    for pid, pgid in groups_of.items():
        if pgid not in groups:
            _quietly(os.kill, pid, sig)
    return set(groups_of)


def _quietly(send: Callable[[int, int], None], target: int, sig: int) -> None:
    try:
        send(target, sig)
    except (ProcessLookupError, PermissionError):
        pass


def process_status(pid: int) -> str:
    """psutil's state of ``pid`` ("running", "sleeping", "stopped", ...); "" once it is gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return ""


def _alive(pids: Iterable[int]) -> List[int]:
    """Pids still running: zombies have exited and only wait for a reap, so they don't count."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids: Set[int], leaders: Set[int], reap: Callable[[], object], timeout: float) -> List[int]:
    """After SIGKILL the kernel needs a moment; a process in uninterruptible sleep (D state)
    may never go, and is reported rather than waited on forever."""
    deadline = time.monotonic() + timeout
    pause = _Backoff()
    while True:
        reap()
        _reap_orphans(pids - leaders)  # the leaders are reaped by their owner
        left = _alive(pids)
        if not left or time.monotonic() >= deadline:
            return left
        pause.sleep()


class _Backoff:
    """Looks after 1, 2, 4 ... ms, then every ``_POLL_S``: a process told to go usually is gone
    within tens of ms (the kernel unmapping its memory), and a restart waits for the last one."""

    def __init__(self) -> None:
        self._next = 0.001

    def sleep(self) -> None:
        time.sleep(self._next)
        self._next = min(self._next * 2, _POLL_S)


def _reap_orphans(pids: Iterable[int]) -> None:
    """Collect re-parented grandchildren, which are our children now; never waitpid(-1),
    which would steal exit statuses that Popen is waiting for."""
    me = os.getpid()
    for pid in pids:
        try:
            if psutil.Process(pid).ppid() == me:
                os.waitpid(pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass
