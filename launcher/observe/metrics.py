"""The run's metrics, derived from this supervisor's event log alone: the one place that turns
events into numbers. Pure: fed the events in order (``fold``), read at a moment. Their names
and help are ``observe.families``'; serving them is ``observe.exporter``'s.

Counters count what this supervisor saw (0 again after a relaunch, as any Prometheus counter);
goodput is the run's own, earlier supervisors included. What cannot be known is NaN, never 0.
"""

import math
from typing import Dict, List, Optional

from launcher.core.events import (
    AttemptEnded,
    AttemptPlanned,
    ChaosInjected,
    CheckpointLoaded,
    CheckpointTotals,
    CopiesNoted,
    CopyRestored,
    Event,
    FirstStep,
    Hang,
    KeptTime,
    Logged,
    NodeReplaced,
    NodesMet,
    OwnWorkNoted,
    StandbyLost,
    Steps,
    Straggler,
    Transition,
)
from launcher.core.group_state import GroupState
from launcher.core.outcomes import AttemptOutcome
from launcher.core.recovery import recoveries

__all__ = ["FAILURE_KINDS", "RunMetrics"]

FAILURE_KINDS = ("crash", "hang", "lost_node", "unknown")
_UNKNOWN = math.nan


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
        self.standby_nodes = _UNKNOWN  # --standby-nodes: standing by in the round (NaN: none asked)
        self.replacements = 0  # a standby took a lost node's place
        self.copies: Optional[CopiesNoted] = None  # --memory-peers: the newest note of this node's copies
        self.copy_restores = 0  # its ranks' snapshots restored from another node's copy
        # The newest attempt's ranks' own work over the median of the others' (where the run is
        # held), and the ranks named slow now: rank → ratio.
        self.own_work: Dict[str, float] = {}
        self.stragglers: Dict[int, float] = {}
        self.downtime = 0.0
        self._phases: List[Logged[Event]] = []  # what recoveries() reads: transitions, loads, first steps
        self._steps: List[Steps] = []  # the newest attempt's last two: its pace
        self.newest_step: Optional[Steps] = None  # of any attempt: the step and its age
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
            self.newest_step = event
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
        elif isinstance(event, NodesMet) and event.standby is not None:
            self.standby_nodes = float(len(event.standby))
        elif isinstance(event, StandbyLost):
            self.standby_nodes = float(event.left)
        elif isinstance(event, NodeReplaced):
            self.replacements += 1
        elif isinstance(event, CopiesNoted):
            self.copies = event
        elif isinstance(event, CopyRestored):
            self.copy_restores += 1
        elif isinstance(event, OwnWorkNoted) and event.attempt == self.attempt:
            self.own_work = dict(event.ratios)
        elif isinstance(event, Straggler) and event.attempt == self.attempt:
            if event.back:
                self.stragglers.pop(event.rank, None)
            else:
                self.stragglers[event.rank] = event.ratio

    def _transition(self, logged: Logged[Event], event: Transition) -> None:
        if event.old is None:
            self.attempts += 1
            self.attempt, self._stepping_since, self._steps = event.attempt, None, []
            self.own_work, self.stragglers = {}, {}
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

    @property
    def checkpoint_totals(self) -> List[CheckpointTotals]:
        """Each attempt's newest totals."""
        return list(self._totals.values())

    def goodput(self, now_wall: float) -> float:
        """As ``recovery.goodput``, the attempt in progress kept from its first step on. Unknown
        (not 0) with nothing kept and no step seen: a script that never beats may never show one."""
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
