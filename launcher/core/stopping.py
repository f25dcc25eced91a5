"""The cooperative stop: when ftlaunch is asked to stop (a signal, a peer node's stop), every rank
that calls ``ft.should_stop(step)`` is given one step to reach, save and leave at, before any
signal reaches it. The rule is pure (``stop_step``); ``CooperativeStop`` carries it out on one
node's group."""

import dataclasses
import math
import time
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from launcher.core.beats import BeatReading

__all__ = ["STOP_PROPAGATION_S", "CooperativeStop", "StepRate", "StopReading", "stop_step"]

# How long the stop request may take to reach every node's ranks, in seconds of stepping: the
# stop step is this far (at the fastest rank's pace) past the furthest step any rank reported.
STOP_PROPAGATION_S = 2.0


@dataclasses.dataclass(frozen=True)
class StopReading:
    """One node's ranks when the stop is asked for: whether every running one listens to
    ft.should_stop, the furthest step any reached, and how fast the fastest steps."""

    aware: bool
    furthest: int
    rate: float  # steps per second

    # A node with no running rank (done, or waiting): it holds no one back.
    @classmethod
    def idle(cls) -> "StopReading":
        return cls(aware=True, furthest=-1, rate=0.0)


def stop_step(readings: Sequence[StopReading]) -> int:
    """The step every rank stops at: past the furthest any rank has reached, by a margin that
    covers the time the request takes to reach every rank at the fastest rank's pace. 0: some
    node has a rank that never calls ft.should_stop (it would leave the others in a collective)."""
    if not readings or not all(r.aware for r in readings):
        return 0
    furthest = max(r.furthest for r in readings)
    if furthest < 0:
        return 0
    fastest = max(r.rate for r in readings)
    return furthest + 2 + math.ceil(fastest * STOP_PROPAGATION_S)


def local_stop_step(reading: StopReading) -> int:
    """One node alone: the step after next (none of its ranks can have checked it yet)."""
    return reading.furthest + 2 if reading.aware else 0


class StepRate:
    """How fast the furthest rank steps, in steps per second: over the attempt so far, or over
    the last quarter second when that is faster (a stop request right after the start must
    still know the pace)."""

    _WINDOW_S = 0.25

    def __init__(self) -> None:
        self._first: Optional[Tuple[float, int]] = None
        self._then: Optional[Tuple[float, int]] = None
        self.rate = 0.0

    def observe(self, now: float, furthest: Optional[int]) -> None:
        if furthest is None:
            return
        if self._first is None or self._then is None:
            self._first = self._then = (now, furthest)
            return
        if now - self._then[0] < self._WINDOW_S:
            return
        recent = (furthest - self._then[1]) / (now - self._then[0])
        overall = (furthest - self._first[1]) / (now - self._first[0])
        self.rate = max(0.0, recent, overall)
        self._then = (now, furthest)


def ranks_past(steps: Dict[int, int], at_step: int) -> List[int]:
    """Ranks already at or past the stop step when asked: they stop where they are."""
    return sorted(rank for rank, step in steps.items() if step >= at_step)


class RunningRanks(Protocol):
    """What a stop needs of the group: its live ranks (rank → pid)."""

    def running(self) -> Mapping[int, int]: ...


class StopBoard(Protocol):
    """What a stop needs of the heartbeat board: each rank's slot, and a place to ask."""

    def read(self) -> Mapping[int, BeatReading]: ...

    def request_stop(self, at_step: int) -> None: ...


class CooperativeStop:
    """Asks one node's running ranks to stop at an agreed step and waits the grace period for
    them to leave. ``agree``: the node's role turns this node's reading into the step for all
    (0: none is asked)."""

    def __init__(
        self,
        grace_period: float,
        agree: Callable[[Optional[StopReading]], int],
        cut_short: Callable[[], bool],
        say: Callable[[str], None],
    ) -> None:
        self._grace = grace_period
        self._agree = agree
        self._cut_short = cut_short
        self._say = say

    def ask(
        self,
        group: RunningRanks,
        board: StopBoard,
        rate: StepRate,
        on_requested: Callable[[int], object],
        turn: Callable[[], bool],
    ) -> int:
        """Agree on the step, leave it in every rank's slot, and wait until every rank has left,
        the grace period ends, or a second signal cuts it short. ``turn()`` is one look at the
        group (exits recorded) that returns True once every rank has exited. Returns the step
        asked for (0: none was)."""
        running = group.running()
        slots = board.read()
        reading = None
        if running:
            aware = all(slots[rank].stop_aware for rank in running)
            furthest = max(slots[rank].step for rank in running)
            reading = StopReading(aware, furthest, rate.rate)
        at_step = self._agree(reading)
        if not running or at_step <= 0:
            return 0  # a rank that would not stop would leave the others blocked in a collective
        board.request_stop(at_step)
        on_requested(at_step)
        self._say(
            f"asking the workers to save and stop at step {at_step} "
            f"(up to {self._grace:g} s; Ctrl+C again: now)"
        )
        now_slots = board.read()
        past = ranks_past({rank: now_slots[rank].step for rank in running}, at_step)
        if past:  # said, so that a missing checkpoint is explained
            self._say(f"rank(s) {past} were already at step {at_step} or past it; they stop where they are")
        deadline = time.monotonic() + self._grace
        while time.monotonic() < deadline and not self._cut_short():
            if turn():
                break
        return at_step
