"""The run's metrics, derived from this supervisor's event log and nothing else: the one place
that turns events into numbers. Pure: fed the events in order (``fold``), read at a moment
(``families``); serving and writing them is ``observe.exporter``'s.

Counters count what this supervisor saw (a relaunched ftlaunch starts them at 0 again, as any
Prometheus counter after a restart); goodput, which only the node that holds the run knows, is
the run's own, earlier supervisors included. What cannot be known is NaN, never 0.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

from launcher.core.events import (
    AttemptEnded,
    AttemptPlanned,
    ChaosInjected,
    CheckpointLoaded,
    CheckpointTotals,
    Event,
    FirstStep,
    Hang,
    KeptTime,
    Logged,
    Steps,
    Transition,
)
from launcher.core.group_state import GroupState
from launcher.core.outcomes import AttemptOutcome
from launcher.core.recovery import recoveries

__all__ = ["FAILURE_KINDS", "TIERS", "Family", "RunMetrics"]

TIERS = ("memory", "storage")
FAILURE_KINDS = ("crash", "hang", "lost_node", "unknown")
_UNKNOWN = math.nan

Value = Union[float, Tuple[float, float]]  # a summary's sample: (count, sum)


@dataclasses.dataclass(frozen=True)
class Family:
    """One metric and its samples, each with its own labels (beside the run's and node's)."""

    name: str
    kind: str  # "counter", "gauge" or "summary"
    help: str
    samples: Tuple[Tuple[Tuple[Tuple[str, str], ...], Value], ...]

    @classmethod
    def one(cls, name: str, kind: str, help: str, value: Value) -> "Family":
        return cls(name, kind, help, (((), value),))

    @classmethod
    def by(cls, name: str, kind: str, help: str, label: str, values: Dict[str, Value]) -> "Family":
        return cls(name, kind, help, tuple((((label, key),), value) for key, value in values.items()))


class RunMetrics:
    """What the events so far say; ``fold`` each new event, in order."""

    def __init__(self) -> None:
        self.attempts = 0
        self.attempt: Optional[int] = None  # the newest attempt on this node
        self.running = False
        self.failures = {kind: 0 for kind in FAILURE_KINDS}
        self.restarts = self.preemptions = self.resizes = self.hangs = self.injected = 0
        self.world_size: Optional[int] = None
        self.nodes: Optional[int] = None
        self.downtime = 0.0
        self._phases: List[Logged[Event]] = []  # what recoveries() reads: transitions, loads, first steps
        self._steps: List[Steps] = []  # the newest attempt's last two: its pace
        self._step: Optional[Steps] = None  # the newest of any attempt: the step and its age
        self._totals: Dict[int, CheckpointTotals] = {}  # per attempt, the newest
        self._kept: Optional[Logged[KeptTime]] = None
        self._stepping_since: Optional[float] = None  # wall: the newest attempt's first step

    def fold(self, logged: Logged[Event]) -> None:
        event = logged.event
        if isinstance(event, Transition):
            self._transition(logged, event)
        elif isinstance(event, (CheckpointLoaded, FirstStep)):
            self._phases.append(logged)
            if isinstance(event, FirstStep) and event.attempt == self.attempt:
                self._stepping_since = logged.t_wall
                self._recount_downtime()
        elif isinstance(event, Steps):
            self._steps = [s for s in self._steps[-1:] if s.attempt == event.attempt] + [event]
            self._step = event
        elif isinstance(event, CheckpointTotals):
            self._totals[event.attempt] = event
        elif isinstance(event, AttemptEnded):
            self._ended(event)
        elif isinstance(event, AttemptPlanned):
            self.world_size, self.nodes = event.world_size, len(event.nodes)
        elif isinstance(event, KeptTime):
            self._kept = Logged(event, logged.t_mono, logged.t_wall)
        elif isinstance(event, Hang):  # a Laggard is not a hang: exact type
            self.hangs += type(event) is Hang
        elif isinstance(event, ChaosInjected):
            self.injected += 1

    def _transition(self, logged: Logged[Event], event: Transition) -> None:
        if event.old is None:
            self.attempts += 1
            self.attempt, self._stepping_since, self._steps = event.attempt, None, []
        self.running = event.new is GroupState.RUNNING
        self._phases.append(logged)
        if event.new in (GroupState.RUNNING, GroupState.STOPPED):
            self._recount_downtime()

    def _ended(self, event: AttemptEnded) -> None:
        if event.outcome == AttemptOutcome.FAILED.value:
            kind = event.cause if event.cause in self.failures else "unknown"
            self.failures[kind] += 1
        self.preemptions += event.outcome == AttemptOutcome.PREEMPTED.value
        self.resizes += event.outcome == AttemptOutcome.RESIZED.value
        self.restarts += event.restarting

    def _recount_downtime(self) -> None:
        """Few events (about six an attempt), so recomputing from them all stays cheap."""
        self.downtime = sum(r.downtime for r in recoveries(self._phases))

    # -- read at a moment -------------------------------------------------------------------------

    def goodput(self, now_wall: float) -> float:
        """As ``recovery.goodput``: the attempt in progress counts as kept from its first step on;
        before it (imports, data, a rendezvous) nothing was spent on steps yet. With nothing kept
        and no step seen yet it is unknown: a script that never beats may never show one (its
        record's goodput is unknown too), and 0 would be a number for what is not known."""
        if self._kept is None or self._kept.event.seconds is None:
            return _UNKNOWN
        kept, since = self._kept.event.seconds, self._kept.event.since
        if self._kept.event.in_progress and self._stepping_since is not None:
            kept += max(0.0, now_wall - max(self._stepping_since, self._kept.t_wall))
        elif self._kept.event.in_progress and kept == 0.0:
            return _UNKNOWN
        total = now_wall - since
        return max(0.0, min(1.0, kept / total)) if total > 0 else _UNKNOWN

    def step_rate(self, now: float) -> float:
        """Steps per second between the newest two readings, or up to now when the step has not
        moved for longer than they were apart (a stalled group slows down to 0). No group runs
        (done, failed, between attempts): no pace, which is not a pace of 0."""
        if not self.running or len(self._steps) < 2:
            return _UNKNOWN
        first, last = self._steps
        apart = last.reported_at - first.reported_at
        if apart <= 0:
            return _UNKNOWN
        return (last.step - first.step) / max(apart, now - last.reported_at)

    def families(self, now: float, now_wall: float) -> List[Family]:
        """Every metric as of ``now`` (monotonic) and ``now_wall``."""
        step = self._step
        return [
            Family.one(
                "ftlaunch_attempts",
                "counter",
                "Attempts (worker groups) started on this node.",
                self.attempts,
            ),
            Family.one(
                "ftlaunch_attempt",
                "gauge",
                "The newest attempt's number (-1: none yet).",
                _or(self.attempt, -1),
            ),
            Family.one(
                "ftlaunch_group_running",
                "gauge",
                "1 while this node's worker group runs.",
                float(self.running),
            ),
            Family.by(
                "ftlaunch_failures",
                "counter",
                "Failed attempts by the root cause's kind (unknown: not described).",
                "kind",
                dict(self.failures),
            ),
            Family.one(
                "ftlaunch_restarts",
                "counter",
                "Attempts followed by another (a failure or a resize).",
                self.restarts,
            ),
            Family.one(
                "ftlaunch_preemptions",
                "counter",
                "Attempts preempted (SIGTERM, the preemption signal).",
                self.preemptions,
            ),
            Family.one(
                "ftlaunch_resizes", "counter", "Attempts ended because the job's nodes changed.", self.resizes
            ),
            Family.one(
                "ftlaunch_hangs_detected", "counter", "Ranks found past their heartbeat deadline.", self.hangs
            ),
            Family.one("ftlaunch_chaos_injected", "counter", "Faults --chaos injected.", self.injected),
            Family.one(
                "ftlaunch_downtime_seconds",
                "counter",
                "Seconds from each failure to the next group's first step, summed over the recoveries.",
                self.downtime,
            ),
            Family.one(
                "ftlaunch_goodput_ratio",
                "gauge",
                "Share of the run's wall time spent on steps that were kept (NaN: unknown, or not "
                "this node's to tell).",
                self.goodput(now_wall),
            ),
            Family.one(
                "ftlaunch_step",
                "gauge",
                "The newest step every rank of this node has reported (NaN: none yet).",
                step.step if step else _UNKNOWN,
            ),
            Family.one(
                "ftlaunch_step_age_seconds",
                "gauge",
                "Seconds since the slowest rank of this node reported that step (NaN: none yet).",
                max(0.0, now - step.reported_at) if step else _UNKNOWN,
            ),
            Family.one(
                "ftlaunch_steps_per_second",
                "gauge",
                "Steps per second, this node's slowest rank (NaN: no group running, or one reading).",
                self.step_rate(now),
            ),
            Family.one(
                "ftlaunch_world_size",
                "gauge",
                "Ranks in the newest attempt (NaN: none yet).",
                _or(self.world_size),
            ),
            Family.one(
                "ftlaunch_nodes", "gauge", "Nodes in the newest attempt (NaN: none yet).", _or(self.nodes)
            ),
            *self._checkpoint_families(),
        ]

    def _checkpoint_families(self) -> Sequence[Family]:
        totals = list(self._totals.values())

        def summed(count: str, seconds: str) -> Tuple[float, float]:
            return float(sum(getattr(t, count) for t in totals)), sum(getattr(t, seconds) for t in totals)

        return [
            Family.by(
                "ftlaunch_checkpoint_save_seconds",
                "summary",
                "Checkpoint saves by this node's ranks and the seconds training waited in them, by tier.",
                "tier",
                {tier: summed(f"saves_{tier}", f"save_{tier}_s") for tier in TIERS},
            ),
            Family.one(
                "ftlaunch_checkpoint_commit_seconds",
                "summary",
                "Steps committed by this node (the job's rank 0 commits them all), and the seconds "
                "from each write to its commit.",
                summed("commits", "commit_s"),
            ),
            Family.by(
                "ftlaunch_checkpoint_load_seconds",
                "summary",
                "Checkpoint loads by this node's ranks and the seconds they took, by tier.",
                "tier",
                {tier: summed(f"loads_{tier}", f"load_{tier}_s") for tier in TIERS},
            ),
        ]


def _or(value: Optional[float], default: float = _UNKNOWN) -> float:
    return float(value) if value is not None else default
