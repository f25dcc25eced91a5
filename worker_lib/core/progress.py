"""Progress heartbeats: ``ft.heartbeat(step)`` on the hot path is three stores into this rank's
slot of a shared-memory file (no system call, no lock, no torch); the supervisor reads the slots.
Attaching registers faulthandler on the signal sent before a hung group is stopped (stacks to
the rank's log).
"""

import contextlib
import faulthandler
import mmap
import os
import signal
import sys
import threading
import time
from typing import Iterator, Optional

from worker_lib.core import contract as c
from worker_lib.core import own_work

__all__ = [
    "chaos_request",
    "count_commit",
    "count_save",
    "heartbeat",
    "mark_loaded",
    "pause_heartbeat",
    "should_stop",
    "stop_beating",
    "STACK_DUMP_SIGNAL",
]

# Real-time, not SIGUSR1/2 (SLURM's --signal and scripts use those); it kills by default, so it
# is sent only to workers whose slot says they registered it.
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 4

_slot: Optional[memoryview] = None  # this rank's SLOT_WORDS int64 words
_beats = 0
# The last beats' times, beat i at [i % RING], for the own-work thread (written before the count).
_ring = [0] * own_work.RING
_chaos_seen = 0  # the last --chaos request word read from the slot


def heartbeat(
    step: int = -1,
    _now_ns=time.monotonic_ns,
    _STEP=c.SLOT_STEP,
    _TIME=c.SLOT_TIME_NS,
    _BEATS=c.SLOT_BEATS,
    _ring=_ring,
    _LAST=own_work.RING - 1,
) -> None:
    """This rank made progress (``step``: where it is, shown when it is the one behind)."""
    # Bound as locals: looking them up as globals was a third of a beat's cost.
    global _beats
    slot = _slot if _slot is not None else _attach()
    now = _now_ns()
    _ring[(_beats + 1) & _LAST] = now
    _beats += 1
    slot[_STEP] = step
    slot[_TIME] = now
    slot[_BEATS] = _beats


if os.environ.get(c.FT_CHAOS) == "1":  # a --chaos rehearsal: beats also look for requests
    # Chosen at import so a plain run's beat pays nothing (mypy refuses the differing signature).
    from worker_lib.core.chaos import slow_down

    def heartbeat(  # type: ignore[misc]  # noqa: F811
        step: int = -1, _beat=heartbeat, _CHAOS=c.SLOT_CHAOS, _slow_down=slow_down
    ) -> None:
        """This rank made progress (``step``: where it is, shown when it is the one behind)."""
        _beat(step)
        slot = _slot if _slot is not None else _attach()  # the beat attached it
        if slot[_CHAOS] != _chaos_seen:
            _chaos_arrived(slot)
        _slow_down()


def chaos_request(point: int):
    """The action ``--chaos`` asks this rank to carry out at ``point`` (a save point), or None."""
    from worker_lib.core import chaos

    slot = _slot if _slot is not None else _attach()
    word = slot[c.SLOT_CHAOS]
    # Left to the beat: a save may run in a background thread, a raise belongs in the training one.
    if word != _chaos_seen and (word >> 8) & 0xFF != c.CHAOS_AT_BEAT:
        _chaos_arrived(slot)
    return chaos.take(point)


def _chaos_arrived(slot) -> None:
    global _chaos_seen
    from worker_lib.core import chaos

    _chaos_seen = slot[c.SLOT_CHAOS]
    chaos.receive(_chaos_seen)


@contextlib.contextmanager
def pause_heartbeat() -> Iterator[None]:
    """A stretch with no beats that is not a hang (a long evaluation), judged by ``--init-timeout``;
    ``ft.init``, ``ft.save_checkpoint`` and ``ft.load_checkpoint`` pause by themselves."""
    slot = _slot if _slot is not None else _attach()
    slot[c.SLOT_TIME_NS] = time.monotonic_ns()
    slot[c.SLOT_PAUSED] += 1
    try:
        yield
    finally:
        slot[c.SLOT_TIME_NS] = time.monotonic_ns()
        slot[c.SLOT_PAUSES] += 1
        slot[c.SLOT_PAUSED] -= 1


def should_stop(step: int) -> bool:
    """True when ftlaunch was asked to stop (Ctrl+C, a preemption) and ``step`` reached the step
    it chose, the same on every rank, to save and leave. Call it after ``ft.heartbeat(step)``;
    before the first call a stop reaches this worker as the signal itself."""
    slot = _slot if _slot is not None else _attach()
    if not slot[c.SLOT_STOP_AWARE]:
        slot[c.SLOT_STOP_AWARE] = 1
    stop_at = slot[c.SLOT_STOP_AT_STEP]
    return stop_at != 0 and step >= stop_at


def mark_loaded(step: Optional[int] = None, tier: int = c.LOADED_NONE, took_ns: int = 0) -> None:
    """The checkpoint is loaded (``step`` from ``tier`` in ``took_ns``; None: a fresh start)."""
    slot = _slot if _slot is not None else _attach()
    slot[c.SLOT_LOADED_TIER] = tier if step is not None else c.LOADED_NONE
    slot[c.SLOT_LOADED_STEP] = step if step is not None else -1
    slot[c.SLOT_LOAD_NS] = took_ns
    slot[c.SLOT_LOADED_NS] = time.monotonic_ns()


def count_save(to_memory: bool, took_ns: int) -> None:
    """A save returned to the training loop after ``took_ns``: counted for the supervisor's
    metrics. Called from the training thread only (each word has one writer)."""
    slot = _slot if _slot is not None else _attach()
    count, spent = (
        (c.SLOT_SAVES_MEMORY, c.SLOT_SAVE_MEMORY_NS)
        if to_memory
        else (c.SLOT_SAVES_STORAGE, c.SLOT_SAVE_STORAGE_NS)
    )
    slot[spent] += took_ns
    slot[count] += 1


def count_commit(took_ns: int) -> None:
    """This rank wrote a step's commit marker, ``took_ns`` after the save was called. Called from
    the background save thread only."""
    slot = _slot if _slot is not None else _attach()
    slot[c.SLOT_COMMIT_NS] += took_ns
    slot[c.SLOT_COMMITS] += 1


def stop_beating() -> None:
    """Done stepping: from now on judged by ``--init-timeout`` (a pause without end)."""
    slot = _slot if _slot is not None else _attach()
    slot[c.SLOT_TIME_NS] = time.monotonic_ns()
    slot[c.SLOT_PAUSED] += 1


def _attach() -> memoryview:
    """Map this rank's slot (a private page outside ftlaunch) and register the stack dump."""
    global _slot
    path = os.environ.get(c.FT_HEARTBEAT_FILE)
    if path:
        index = int(os.environ.get(c.LOCAL_RANK, "0"))
        with open(path, "r+b") as handle:  # the mapping outlives the file object
            mapped = mmap.mmap(handle.fileno(), 0)  # the whole file: one slot per local rank
        words = memoryview(mapped).cast("q")[index * c.SLOT_WORDS :][: c.SLOT_WORDS]
        words[c.SLOT_DUMP_SIGNAL] = _register_stack_dump()
    else:
        words = memoryview(mmap.mmap(-1, c.SLOT_WORDS * 8)).cast("q")
    words[c.SLOT_MAIN_THREAD] = threading.main_thread().ident or 0
    words[c.SLOT_PID] = os.getpid()
    _slot = words
    if path:
        own_work.start(words, lambda: _beats, _ring)
    return words


def _register_stack_dump() -> int:
    try:
        # None where there is no stderr: faulthandler then tries sys.stderr (RuntimeError below).
        faulthandler.register(
            STACK_DUMP_SIGNAL,
            file=sys.__stderr__,  # type: ignore[arg-type]
            all_threads=True,
            chain=False,
        )
    except (ValueError, RuntimeError, AttributeError):  # no usable stderr (closed, replaced)
        return 0
    return int(STACK_DUMP_SIGNAL)
