"""Each rank's own work per step, measured without the script's help, for ftlaunch's straggler
report. In synchronous training every rank's step takes the same wall time: the fast ranks wait
for the slow one inside a collective. What differs is how late each rank *enters* its collectives.
So a step's own work is the time from its start (the rank's previous beat) to the last collective
the rank entered before the step's beat: its data loading, forward and backward, without the wait
that follows. (DDP enters its gradient buckets' allreduces as backward runs and waits for them
at its end: the wait comes after the last one. FSDP waits between its collectives too, which
counts as own work here: a straggler is still the rank with the most.)

When each collective was entered comes from torch's flight recorder (``TORCH_FR_BUFFER_SIZE``,
which ftlaunch sets for its workers; torch 2.13 records gloo's collectives as NCCL's). A daemon
thread reads it every few seconds, with the recent beats' times (``progress`` keeps the last
``RING`` of them), and adds what it measured to the rank's slot: the beat pays one store more.
A step with no collective (one process, or beats between collectives) is not measured: unknown,
never zero. On GPUs a collective is "entered" when the CPU enqueues it, which runs ahead of the
GPU: the figure there is the CPU's side of a step (not measured on a GPU yet).
"""

import bisect
import json
import os
import sys
import threading
import time
from typing import Callable, List, Optional

from worker_lib.core import contract as c

__all__ = ["RING", "last_collective", "start", "step_own_work"]

RING = 16  # beats whose times are kept (a power of two: the beat masks its index)
PERIOD_S = 2.0  # how often the flight recorder is read (a dump of 512 entries: ~10 ms)


def step_own_work(beats: List[int], entered: List[int], oldest_kept: Optional[int]) -> List[tuple]:
    """(own ns, step ns) for each step between consecutive ``beats`` (times, ascending) that
    entered a collective: from the step's start to the last collective ``entered`` (ascending
    times) before its end. ``oldest_kept``: the oldest entry's time when the recorder's ring has
    dropped older ones (a step that began before it may have lost its entries: skipped)."""
    measured = []
    for start, end in zip(beats, beats[1:]):
        if oldest_kept is not None and start < oldest_kept:
            continue
        last = bisect.bisect_right(entered, end) - 1
        if last >= 0 and entered[last] > start:
            measured.append((entered[last] - start, end - start))
    return measured


def last_collective(entries: List[dict]) -> tuple:
    """(sequence number, kind index) of the last collective entered in the default process group
    (pg_id 0), from the flight recorder's entries; (0, 0) when it entered none."""
    ours = [e for e in entries if str(e.get("pg_id", "")) == "0" and not e.get("is_p2p")]
    if not ours:
        return 0, 0
    last = max(ours, key=lambda e: int(e.get("collective_seq_id") or 0))
    name = str(last.get("profiling_name", "")).rpartition(":")[2]
    kind = c.COLLECTIVE_KINDS.index(name) if name in c.COLLECTIVE_KINDS else 0
    return int(last.get("collective_seq_id") or 0), kind


class _Meter(threading.Thread):
    def __init__(self, slot: memoryview, beats: Callable[[], int], ring: List[int]) -> None:
        super().__init__(name="ftlaunch-own-work", daemon=True)
        self._slot, self._beats, self._ring = slot, beats, ring
        self._measured = 1  # the last beat whose step was measured or passed over (before 1: init)

    def run(self) -> None:
        try:
            while True:
                time.sleep(PERIOD_S)
                if not self._measure():
                    return
        except Exception as err:  # noqa: BLE001 - never the training's end: said once, unknown since
            print(f"[ftlaunch] this rank's own work is no longer measured: {err!r}", file=sys.stderr)

    def _measure(self) -> bool:
        """False once it cannot ever measure (no flight recorder in this torch)."""
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return True  # not yet (or no longer) a process group: nothing to measure
        dump = getattr(sys.modules.get("torch._C._distributed_c10d"), "_dump_fr_trace_json", None)
        if dump is None:  # a torch without the flight recorder
            return False
        first, times, last = self._beats(), list(self._ring), self._beats()
        to_wall = time.time_ns() - time.monotonic_ns()  # the recorder's times are the wall clock's
        entries = json.loads(dump(True, False)).get("entries") or []
        self._note_last_collective(entries)  # a hang beats no more: read it all the same
        # Beat i is written before the count says i; while the ring was copied, beats up to
        # last + 1 may have overwritten theirs: last - RING + 2 onwards are intact.
        since = max(self._measured, last - RING + 2)
        if first - since < 1:
            return True
        beats = [times[i % RING] + to_wall for i in range(since, first + 1)]
        entered = sorted(e["time_created_ns"] for e in entries if e.get("time_created_ns"))
        full = len(entries) >= _capacity()
        oldest = entered[0] if full and entered else None
        for own, whole in step_own_work(beats, entered, oldest):
            self._slot[c.SLOT_OWN_NS] += own
            self._slot[c.SLOT_OWN_STEP_NS] += whole
            self._slot[c.SLOT_OWN_STEPS] += 1
        self._measured = first
        return True

    def _note_last_collective(self, entries: List[dict]) -> None:
        seq, kind = last_collective(entries)
        same = self._slot[c.SLOT_COLLECTIVE_READS] and self._slot[c.SLOT_COLLECTIVE_SEQ] == seq
        self._slot[c.SLOT_COLLECTIVE_SAME] = self._slot[c.SLOT_COLLECTIVE_SAME] + 1 if same else 0
        self._slot[c.SLOT_COLLECTIVE_SEQ] = seq
        self._slot[c.SLOT_COLLECTIVE_KIND] = kind
        self._slot[c.SLOT_COLLECTIVE_READS] += 1


def _capacity() -> int:
    try:
        return int(os.environ.get(c.FR_BUFFER_SIZE, "0"))
    except ValueError:
        return 0


def start(slot: memoryview, beats: Callable[[], int], ring: List[int]) -> None:
    """Measure this rank's own work into ``slot`` (its heartbeat slot) while the process lives,
    where torch's flight recorder is on; ``beats()``: the beats so far, ``ring``: their times."""
    if _capacity() > 0:
        _Meter(slot, beats, ring).start()
