"""Stragglers: the rank whose own work (worker_lib.core.own_work) every other rank waits for. Each
node keeps its ranks' figures over ``--straggler-window`` (``OwnWorkWindow``); where the run is
held, the judge compares every rank of the job with the median of the others (``StragglerJudge``)
and says who became slow and who is back. Pure: fed readings and times, it decides only."""

import collections
import dataclasses
import statistics
from typing import Callable, Deque, Dict, List, Mapping, Optional, Tuple

from launcher.core.beats import OwnWork, ProgressRow

__all__ = ["OwnWorkWindow", "Slowdown", "StragglerJudge", "own_work_ratios"]

_MIN_STEPS = 3  # steps measured in the window before a figure is given
_SAMPLE_EVERY_S = 1.0


class OwnWorkWindow:
    """One attempt's local ranks: the mean own work a step over the last ``window`` seconds,
    from the slots' cumulative counters."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._samples: Dict[int, Deque[Tuple[float, OwnWork]]] = {}
        self._next = 0.0

    def observe(self, now: float, read: Callable[[], Mapping[int, OwnWork]]) -> None:
        """``read()``: the slots' counters, read only when a sample is due."""
        if now < self._next:
            return
        self._next = now + _SAMPLE_EVERY_S
        for rank, counted in read().items():
            samples = self._samples.setdefault(rank, collections.deque())
            samples.append((now, counted))
            # Keep one sample at or before the window's start: the base the window is measured from.
            while len(samples) > 2 and samples[1][0] <= now - self._window:
                samples.popleft()

    def figure(self, rank: int) -> Optional[float]:
        """Seconds of own work a step over the window; None until the window is half covered and
        a few steps were measured in it (a rank that enters no collective never has one)."""
        samples = self._samples.get(rank)
        if not samples or len(samples) < 2:
            return None
        (since, base), (now, newest) = samples[0], samples[-1]
        steps = newest.steps - base.steps
        if now - since < self._window / 2 or steps < _MIN_STEPS:
            return None
        return (newest.own_ns - base.own_ns) / steps / 1e9

    def figures(self) -> Dict[int, float]:
        found = {rank: self.figure(rank) for rank in self._samples}
        return {rank: f for rank, f in found.items() if f is not None}


def own_work_ratios(rows: List[ProgressRow]) -> Dict[int, float]:
    """Each measured rank's own work over the median of the other measured ranks' (the slow one's
    own peers are the rest of the job, so one slow rank of two is as plain as one of a thousand)."""
    figures = {row.rank: row.own_work for row in rows if row.own_work is not None}
    ratios = {}
    for rank, own in figures.items():
        others = [f for r, f in figures.items() if r != rank]
        if others and statistics.median(others) > 0:
            ratios[rank] = own / statistics.median(others)
    return ratios


@dataclasses.dataclass(frozen=True)
class Slowdown:
    """A rank named slow (or back to speed): its own work against the median of the others'."""

    rank: int
    node: Optional[int]  # None: the only node
    ratio: float
    back: bool = False


class StragglerJudge:
    """Belongs to the supervisor that holds the run, one attempt long."""

    def __init__(self, factor: float) -> None:
        self._factor = factor
        self._slow: Dict[int, float] = {}  # named ranks, their ratio when named

    @property
    def slow(self) -> Dict[int, float]:
        return dict(self._slow)

    def judge(self, rows: List[ProgressRow]) -> List[Slowdown]:
        """Who became slow, and who named before is back (a rank no longer measured is left as
        it was: unknown is not back)."""
        nodes = {row.rank: row.node for row in rows}
        changes = []
        for rank, ratio in sorted(own_work_ratios(rows).items()):
            if ratio >= self._factor and rank not in self._slow:
                self._slow[rank] = ratio
                changes.append(Slowdown(rank, nodes.get(rank), ratio))
            elif ratio < self._factor and rank in self._slow:
                del self._slow[rank]
                changes.append(Slowdown(rank, nodes.get(rank), ratio, back=True))
        return changes
