"""When silence is a hang: deadlines from heartbeats. Pure: readings and clock times come in,
verdicts go out (tests script both). Nothing is judged until the script is known to beat; then
a rank paused or starting gets ``init_timeout``, a stepping one the heartbeat deadline (fixed, or
``auto``: ``factor`` x the intervals' p99, at least ``floor``). A rank beating at one step is
*stalled*: a hang after ``progress_timeout``, else named first when its peers go silent.
"""

import collections
import dataclasses
from typing import Deque, Dict, List, NamedTuple, Optional

from launcher.core.beats import BeatReading, Phase

__all__ = ["HangLimits", "HangWatch", "Overdue", "MIN_SAMPLES"]

MIN_SAMPLES = 10  # beat intervals needed before an auto deadline replaces init_timeout
_WINDOW = 200  # the most recent intervals (all ranks together) the auto deadline is learned from


@dataclasses.dataclass(frozen=True)
class HangLimits:
    init_timeout: float  # seconds: start, or a pause, to the next sign of life
    heartbeat_timeout: Optional[float]  # seconds between beats; None: auto
    floor: float = 120.0  # auto never sets a deadline below this
    factor: float = 10.0  # auto deadline: factor x p99 of the step interval
    progress_timeout: Optional[float] = None  # seconds a rank may beat without a new step; None: off


@dataclasses.dataclass(frozen=True)
class Overdue:
    """A rank whose silence has lasted ``silent_for`` seconds against a ``deadline``."""

    rank: int
    phase: Phase
    silent_for: float
    deadline: float
    last_step: int  # -1: it never said
    silent_since: float  # monotonic time of its last sign of life (stalled: of its last new step)
    stalled: bool = False  # it beats, at the same step since ``silent_since``


class _Step(NamedTuple):
    """Where a rank's step last moved: the step, the pauses it had made then, when, its beats."""

    step: int
    pauses: int
    since: float
    beats: int


class HangWatch:
    """One attempt's deadlines. ``known_to_beat``: an earlier attempt of the run saw a beat."""

    def __init__(self, limits: HangLimits, started_at: float, known_to_beat: bool = False) -> None:
        self.limits = limits
        self.started_at = started_at
        self.known_to_beat = known_to_beat
        self._intervals: Deque[float] = collections.deque(maxlen=_WINDOW)
        self._learned: Optional[float] = None
        self._previous: Dict[int, BeatReading] = {}
        self._steps: Dict[int, _Step] = {}  # where each rank's step last moved (or a pause ended)
        self.all_stepping = False  # every rank has beaten at least once (set by the monitor)
        self.all_loaded = False  # every rank's checkpoint load has returned (set by the monitor)

    @property
    def step_deadline(self) -> Optional[float]:
        """The deadline between beats now in force; None while auto is still learning."""
        if self.limits.heartbeat_timeout is not None:
            return self.limits.heartbeat_timeout
        return self._learned

    def observe(self, readings: Dict[int, BeatReading]) -> None:
        """Take in the slots of the ranks still running."""
        for rank, now in readings.items():
            before = self._previous.get(rank)
            if now.beats > 0:
                self.known_to_beat = True
            if before is not None and _is_clean_interval(before, now):
                self._intervals.append((now.active_at - before.active_at) / (now.beats - before.beats))
            self._previous[rank] = now
            moved = self._steps.get(rank)
            if now.beats > 0 and (moved is None or (moved.step, moved.pauses) != (now.step, now.pauses)):
                self._steps[rank] = _Step(now.step, now.pauses, now.active_at, now.beats)
        if self.limits.heartbeat_timeout is None and len(self._intervals) >= MIN_SAMPLES:
            self._learned = max(self.limits.floor, self.limits.factor * _p99(self._intervals))

    def silences(self, now: float, readings: Dict[int, BeatReading]) -> List[Overdue]:
        """Every rank under a deadline, with how long it has been silent (judge by ``overdue``)."""
        if not self.known_to_beat:
            return []
        found = []
        for rank, r in readings.items():
            phase = r.phase
            if phase is Phase.STARTING:  # since the group started, or its last pause ended
                since, deadline = max(self.started_at, r.active_at), self.limits.init_timeout
            elif phase is Phase.STEPPING:
                since, deadline = r.active_at, self.step_deadline or self.limits.init_timeout
            else:
                since, deadline = r.active_at, self.limits.init_timeout
            found.append(Overdue(rank, phase, now - since, deadline, r.step, since))
        return found

    def stalls(self, now: float, readings: Dict[int, BeatReading]) -> List[Overdue]:
        """Every rank beating at one step, with how long it has not moved, against
        ``progress_timeout`` (else the beat deadline); ranks with no step or paused are not judged."""
        found = []
        for rank, r in readings.items():
            moved = self._steps.get(rank)
            if r.phase is not Phase.STEPPING or r.step < 0 or moved is None or r.beats <= moved.beats:
                continue
            deadline = self.limits.progress_timeout or self.step_deadline or self.limits.init_timeout
            found.append(
                Overdue(rank, Phase.STEPPING, now - moved.since, deadline, r.step, moved.since, True)
            )
        return found

    def stalled(self, now: float, readings: Dict[int, BeatReading]) -> List[Overdue]:
        """With ``progress_timeout``: the ranks that have beaten without a new step for longer."""
        if self.limits.progress_timeout is None or not self.known_to_beat:
            return []
        return [s for s in self.stalls(now, readings) if s.silent_for > s.deadline]

    def overdue(self, now: float, readings: Dict[int, BeatReading]) -> List[Overdue]:
        """The ranks past their deadline: hung (silent, or stalled past --progress-timeout)."""
        silent = [s for s in self.silences(now, readings) if s.silent_for > s.deadline]
        return silent + self.stalled(now, readings)

    def silent_with(self, now: float, readings: Dict[int, BeatReading]) -> List[Overdue]:
        """Once a rank is overdue, those silent or stalled with it, no further on, for over half a
        deadline: peers blocked in a hung rank's collective go silent a few beats apart, and the
        hung rank must be blamed even when a peer's deadline passed first."""
        silences = self.silences(now, readings)
        overdue = self.overdue(now, readings)
        if not overdue:
            return []
        missed, furthest = min(o.deadline for o in overdue), max(o.last_step for o in overdue)
        named = [
            s
            for s in silences
            if s.silent_for > s.deadline / 2 or (s.silent_for > missed / 2 and s.last_step <= furthest)
        ]
        silent = {s.rank for s in named}
        stalled = [
            s
            for s in self.stalls(now, readings)
            if s.rank not in silent and s.silent_for > missed / 2 and s.last_step <= furthest
        ]
        return named + stalled

    def never_beat(self, now: float) -> bool:
        """No rank has beaten within ``init_timeout`` of the start: the script does not beat."""
        return not self.known_to_beat and now - self.started_at > self.limits.init_timeout


def _is_clean_interval(before: BeatReading, now: BeatReading) -> bool:
    """Beats between two readings with no pause in between and not the first step (which
    includes start-up work such as compilation)."""
    return (
        now.beats > before.beats > 0 and now.pauses == before.pauses and not now.paused and not before.paused
    )


def _p99(values) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]
