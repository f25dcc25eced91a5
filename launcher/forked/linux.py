"""The Linux process controls ftlaunch relies on: prctl(2), what a process shows of itself, and
its memory's pages (the fork server's, in huge pages)."""

import ctypes
import ctypes.util
import mmap
import os
import signal
from typing import Callable, Iterable, List, Sequence, Tuple

__all__ = [
    "anonymous_pieces",
    "become_subreaper",
    "collapse_to_huge_pages",
    "die_with_parent",
    "huge_pages_allowed",
    "ignoring",
    "pieces_of",
    "resident_share",
    "set_parent_death_signal",
    "show_as",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
# /proc/PID/stat's fields (counted from 1) that bound the command line and the environment.
_ARG_START, _ENV_END = 48, 51

_HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB pages) PMD size
_MADV_COLLAPSE = 25  # Linux 6.1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def become_subreaper() -> None:
    """Orphaned descendants (a DataLoader worker whose rank died) are re-parented to us, not
    to init, so the supervisor can still find, kill and reap every process it caused."""
    if _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def set_parent_death_signal(sig: int) -> None:
    """This process receives ``sig`` when its parent dies (see ``die_with_parent``)."""
    _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def ignoring(signals: Sequence[int]) -> Callable[[], None]:
    """A ``preexec_fn`` that sets ``signals`` to SIG_IGN, which survives exec: SLURM sends its
    preemption notice to every process of the step, and one a worker never asked for must not
    kill it (a script that installs its own handler still gets it)."""

    def _in_child() -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    return _in_child


def die_with_parent(sig: int = signal.SIGKILL, ignore: Sequence[int] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies, even by
    SIGKILL, and ignore the signals in ``ignore``. Everything is prepared here, before the fork,
    so the child only calls prctl and sets dispositions.

    The kernel fires it when the *thread* that forked the child exits: spawn from the
    supervisor's main thread only.
    """
    parent = os.getpid()
    ignore_them = ignoring(ignore)

    def _in_child() -> None:
        ignore_them()
        _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return _in_child


def show_as(name: str, argv: Sequence[str], environ: Sequence[str]) -> None:
    """What ps, top and /proc/PID/{comm,cmdline,environ} show of this process: a worker forked
    from the fork server looks like the script it runs, with its rank's variables, not like the
    fork server. The command line and the environment are written over the memory the kernel
    shows them from (as setproctitle does), each cut at a whole entry to the room it has;
    ``environ``: ``KEY=VALUE`` entries, those to keep first. Cosmetic: where the kernel refuses
    (a hardened /proc), nothing changes."""
    buffer = ctypes.create_string_buffer(name.encode()[:15])
    _prctl(_PR_SET_NAME, ctypes.cast(buffer, ctypes.c_void_p).value or 0, 0, 0, 0)
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        # fields[0] is field 3 (the state): field N is fields[N - 3]
        arg_start, arg_end, env_start, env_end = (int(f) for f in fields[_ARG_START - 3 : _ENV_END - 2])
        with open("/proc/self/mem", "r+b", buffering=0) as memory:
            for start, end, entries in ((arg_start, arg_end, argv), (env_start, env_end, environ)):
                memory.seek(start)
                memory.write(_fitted(entries, end - start))
    except (OSError, ValueError, IndexError):
        pass


def _fitted(entries: Sequence[str], room: int) -> bytes:
    """NUL-terminated entries, as many whole ones as fit in ``room`` bytes, NUL-padded to it."""
    data = b""
    for entry in entries:
        piece = entry.encode(errors="replace") + b"\0"
        if len(data) + len(piece) > room:
            break
        data += piece
    return data.ljust(room, b"\0")


def anonymous_pieces(size: int = _HUGE_PAGE) -> List[Tuple[int, int]]:
    """This process's private writable anonymous memory (its heap and anonymous mappings), as
    (start, length) pieces of at most ``size`` bytes, on huge-page boundaries: what a fork copies
    page table by page table, and what a forked child's exit tears down."""
    with open("/proc/self/maps") as maps:
        return pieces_of(maps, size)


def pieces_of(maps: Iterable[str], size: int) -> List[Tuple[int, int]]:
    """``anonymous_pieces`` of the lines of a /proc/PID/maps."""
    pieces: List[Tuple[int, int]] = []
    for line in maps:
        fields = line.split()
        if fields[1][1:2] != "w" or fields[1][3:4] != "p" or fields[5:6] not in ([], ["[heap]"]):
            continue  # read-only, shared, a file's, a stack
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        start += -start % _HUGE_PAGE
        end -= end % _HUGE_PAGE
        pieces.extend((at, min(size, end - at)) for at in range(start, end, size))
    return pieces


def collapse_to_huge_pages(start: int, length: int) -> bool:
    """Back [start, start + length) with huge pages now (madvise MADV_COLLAPSE). False where the
    kernel cannot: older than 6.1, THP disabled, no free huge page, memory that is not plain."""
    return _madvise(start, length, _MADV_COLLAPSE) == 0


def resident_share(start: int, length: int) -> float:
    """The share of [start, start + length)'s pages that are in memory (mincore(2)); 0.0 where it
    cannot be told. Memory reserved but never written is not: a huge page over it would be."""
    pages = length // mmap.PAGESIZE
    vector = ctypes.create_string_buffer(pages)
    if pages == 0 or _mincore(start, length, vector) != 0:
        return 0.0
    return sum(byte & 1 for byte in vector.raw) / pages


def huge_pages_allowed(setting: str = _THP_ENABLED) -> bool:
    """Whether this machine's administrator left transparent huge pages on (``always`` or
    ``madvise``): MADV_COLLAPSE itself ignores the setting, so we read it."""
    try:
        with open(setting) as chosen:
            return "[never]" not in chosen.read()
    except OSError:  # no THP in this kernel
        return False
