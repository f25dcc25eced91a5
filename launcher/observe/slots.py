"""One attempt's heartbeat slots as events of the run log, which the metrics and the picture are
drawn from: ``Steps`` while the step moves, ``CheckpointTotals`` when worker_lib's counters
change. Looked at from the attempt's monitor loop: between two due times a look is one comparison."""

from typing import Callable, Dict, Iterable, Optional

from launcher.core.beats import BeatReading, CheckpointCounters
from launcher.core.events import CheckpointTotals, EventLog, Steps
from worker_lib.core import contract as c

__all__ = ["SlotObserver", "checkpoint_totals"]

# How often, at most (always at the first beat and the end): events.jsonl is rewritten whole with
# run.json, so these rates keep a weekend's log to about 2 MB.
_EARLY_S = 60.0
_STEPS_EVERY_S = (5.0, 15.0)  # early, later
_TOTALS_EVERY_S = (5.0, 60.0)
_COUNTERS_READ_S = 1.0


class SlotObserver:
    """Belongs to one attempt on this node."""

    def __init__(self, events: EventLog, attempt: int) -> None:
        self._events = events
        self._attempt = attempt
        self._steps: Optional[Steps] = None
        self._totals = CheckpointTotals(attempt)
        self._born: Optional[float] = None  # the first look
        self._steps_due = 0.0  # the first: as soon as every rank has beaten
        self._totals_due = 0.0
        self._read_due = 0.0

    def look(
        self,
        now: float,
        slots: Dict[int, BeatReading],
        running: Iterable[int],
        counters: Callable[[], Dict[int, CheckpointCounters]],
    ) -> None:
        """``slots``: every local rank's, by rank; ``running``: the ranks still running;
        ``counters()`` reads the slots' checkpoint counters, only when they are due."""
        self._born = now if self._born is None else self._born
        later = now - self._born >= _EARLY_S
        if now >= self._steps_due and self._note_steps([slots[r] for r in running if r in slots]):
            self._steps_due = now + _STEPS_EVERY_S[later]
        if now >= max(self._totals_due, self._read_due):
            self._read_due = now + _COUNTERS_READ_S
            if self._note_totals(counters(), slots):
                self._totals_due = now + _TOTALS_EVERY_S[later]

    def final(self, slots: Dict[int, BeatReading], counters: Dict[int, CheckpointCounters]) -> None:
        """The attempt is over: where its ranks got to, and what they saved."""
        self._note_steps(list(slots.values()))
        self._note_totals(counters, slots)

    def _note_steps(self, readings) -> bool:
        """A Steps event when every rank has beaten with a step and the steps moved."""
        if not readings or any(r.beats == 0 or r.step < 0 for r in readings):
            return False
        slowest = min(readings, key=lambda r: r.step)
        furthest = max(r.step for r in readings)
        if self._steps is not None and (self._steps.step, self._steps.furthest) == (slowest.step, furthest):
            return False
        self._steps = Steps(self._attempt, slowest.step, furthest, slowest.active_at)
        self._events.emit(self._steps)
        return True

    def _note_totals(self, counters: Dict[int, CheckpointCounters], slots: Dict[int, BeatReading]) -> bool:
        """A CheckpointTotals event when the counters changed."""
        totals = checkpoint_totals(self._attempt, counters, slots)
        if totals == self._totals:
            return False
        self._totals = totals
        self._events.emit(totals)
        return True


# Where a load read its bytes, for the load metrics: another node's copy is read from this node's
# memory tier (it was put there before the rank started).
_READ_FROM = {c.LOADED_MEMORY: "memory", c.LOADED_PEER: "memory", c.LOADED_STORAGE: "storage"}


def checkpoint_totals(
    attempt: int, counters: Dict[int, CheckpointCounters], slots: Dict[int, BeatReading]
) -> CheckpointTotals:
    """The node's ranks' counters summed; each rank's load under the tier its slot names."""
    loads = {"memory": [0, 0], "storage": [0, 0]}
    for rank, reading in slots.items():
        tier = _READ_FROM.get(reading.loaded_tier)
        if reading.loaded_at > 0 and tier is not None and rank in counters:
            loads[tier][0] += 1
            loads[tier][1] += counters[rank].load_ns
    every = list(counters.values())
    return CheckpointTotals(
        attempt,
        saves_memory=sum(n.saves_memory for n in every),
        save_memory_s=sum(n.save_memory_ns for n in every) / 1e9,
        saves_storage=sum(n.saves_storage for n in every),
        save_storage_s=sum(n.save_storage_ns for n in every) / 1e9,
        commits=sum(n.commits for n in every),
        commit_s=sum(n.commit_ns for n in every) / 1e9,
        loads_memory=loads["memory"][0],
        load_memory_s=loads["memory"][1] / 1e9,
        loads_storage=loads["storage"][0],
        load_storage_s=loads["storage"][1] / 1e9,
    )
