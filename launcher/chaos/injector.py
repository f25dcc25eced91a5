"""When each fault of a --chaos plan fires, and at whom: decisions only (tests script the clock and
the slots); the attempt runner sends the signals. A target rank is drawn from the seed when its
fault is armed, so one seed picks the same ranks in order. Every node runs the same plan and
injects only into its own ranks; a node's fault (kill-node, bad-node) acts only on the node it
names, on whatever ranks that node runs then (a standby in its place is another node)."""

import dataclasses
import random
import signal
from typing import AbstractSet, List, Mapping, Optional

from launcher.core.beats import BeatReading
from launcher.core.failures import Failure, HangFailure, ProcessFailure
from launcher.grammar.chaos import ChaosPlan, Fault, FaultKind, TriggerKind
from worker_lib.core import contract as c

__all__ = ["ChaosInjector", "Injection", "mark_injected", "not_landed"]

# The failures a fault can be the cause of (a lost node is a supervisor's, never a rank's).
_MARKABLE = (ProcessFailure, HangFailure)

# The longest gap between two looks that counts as running time for every=: the monitor looks
# every 50 ms, so a longer gap is time with no workers (between attempts), not running time.
_MAX_TICK_S = 1.0


@dataclasses.dataclass(frozen=True)
class Injection:
    """One fault to inject now: a signal the supervisor sends, or a request it leaves in the
    rank's heartbeat slot for worker_lib to carry out (``request``: the slot word, else 0)."""

    fault: str  # the fault's clause, as normalized
    kind: str  # FaultKind value
    signum: int  # what the rank dies or stops of; 0: an exception or a sleep
    rank: int
    pid: int
    request: int = 0


@dataclasses.dataclass
class _Armed:
    fault: Fault
    rank: int  # the target
    fired: int = 0
    due: float = 0.0  # EVERY: running seconds at which it fires next


@dataclasses.dataclass
class _NodeArmed:
    """A fault of this node: kill-node fires once; bad-node once in each attempt."""

    fault: Fault
    fired: int = 0  # attempts it acted in
    this_attempt: bool = False


class ChaosInjector:
    def __init__(
        self,
        plan: ChaosPlan,
        world_size: int,
        local: AbstractSet[int],
        started: float,
        node: Optional[int] = None,
    ) -> None:
        self._world = world_size
        self._local = local  # the global ranks this node runs
        self._rng = random.Random(plan.seed)
        self._started = started  # monotonic: when the supervisor started (at= counts from it)
        self._running_s = 0.0  # how long workers have run, over every attempt
        self._last_look: Optional[float] = None
        self._attempt_from: Optional[float] = None  # the attempt's first look with workers running
        self._requests = 0  # slot requests so far: each gets a new sequence number
        # Node faults draw no rank: the rank faults' draws are those of a plan without them.
        self._armed = [self._arm(_Armed(fault, 0)) for fault in plan.faults if not fault.kind.of_a_node]
        self._own = [_NodeArmed(f) for f in plan.faults if f.kind.of_a_node and f.node == node]

    def _arm(self, armed: _Armed) -> _Armed:
        fault = armed.fault
        armed.rank = fault.rank if fault.rank is not None else self._rng.randrange(self._world)
        if fault.trigger.kind is TriggerKind.EVERY:
            spread = fault.trigger.jitter
            armed.due = self._running_s + fault.trigger.at + self._rng.uniform(-spread, spread)
        return armed

    def attempt_started(self, local: Optional[AbstractSet[int]] = None) -> None:
        """The time since the last look was not running time (the group was down). ``local``:
        the global ranks this node runs from now on, where they moved (a standby's new place)."""
        if local is not None:
            self._local = local
        self._last_look = None
        self._attempt_from = None
        for armed in self._own:
            armed.this_attempt = False

    def look(
        self, now: float, running: Mapping[int, int], slots: Mapping[int, BeatReading]
    ) -> List[Injection]:
        """The faults due now among ``running`` (rank → pid: this node's live workers);
        ``slots``: their heartbeat slots (rank → reading)."""
        if self._last_look is not None and running:
            self._running_s += min(now - self._last_look, _MAX_TICK_S)
        self._last_look = now
        if running and self._attempt_from is None:
            self._attempt_from = now
        due = self._rank_faults(now, running, slots)
        return due + [i for armed in self._own for i in self._node_fault(armed, now, running, slots)]

    def _rank_faults(
        self, now: float, running: Mapping[int, int], slots: Mapping[int, BeatReading]
    ) -> List[Injection]:
        due = []
        for armed in self._armed:
            fault = armed.fault
            if fault.times is not None and armed.fired >= fault.times:
                continue
            here = armed.rank in self._local
            if here and armed.rank not in running:
                continue  # it has exited: the attempt is ending anyway
            if not self._fires(armed, now, slots.get(armed.rank)):
                continue
            if here:
                self._requests += 1
                pid, request = running[armed.rank], _request_word(fault, self._requests)
                due.append(
                    Injection(str(fault), fault.kind.value, fault.kind.signum, armed.rank, pid, request)
                )
            armed.fired += 1
            self._arm(armed)
        return due

    def _node_fault(
        self, armed: _NodeArmed, now: float, running: Mapping[int, int], slots: Mapping[int, BeatReading]
    ) -> List[Injection]:
        """This node's fault, due now: every running rank of it (kill-node: the node, rank -1)."""
        fault = armed.fault
        spent = fault.times is not None and armed.fired >= fault.times
        if spent or armed.this_attempt or not running or not self._node_fires(fault, now, running, slots):
            return []
        armed.fired, armed.this_attempt = armed.fired + 1, True
        if fault.kind is FaultKind.KILL_NODE:
            return [Injection(str(fault), fault.kind.value, fault.kind.signum, -1, 0)]
        return [
            Injection(str(fault), fault.kind.value, fault.kind.signum, rank, pid)
            for rank, pid in sorted(running.items())
        ]

    def _node_fires(
        self, fault: Fault, now: float, running: Mapping[int, int], slots: Mapping[int, BeatReading]
    ) -> bool:
        """kill-node's at= counts from the supervisor's start, bad-node's from each attempt's; a
        step is the furthest any rank of the node has beaten to."""
        trigger = fault.trigger
        if trigger.kind is TriggerKind.STEP:
            steps = [s.step for r, s in slots.items() if r in running and s.beats > 0]
            return bool(steps) and max(steps) >= trigger.at
        since = self._started if fault.kind is FaultKind.KILL_NODE else self._attempt_from
        return since is not None and now - since >= trigger.at

    def ask_again(self, injection: Injection) -> None:
        """A request worker_lib never carried out (its rank was stopped first, e.g. by a peer's
        failure in the same save): the fault is due again, at the same rank, in a later attempt."""
        for armed in self._armed:
            if str(armed.fault) == injection.fault and armed.fired > 0:
                armed.fired -= 1
                armed.rank = injection.rank  # firing drew the next target: this one is not done
                return

    def _fires(self, armed: _Armed, now: float, slot: Optional[BeatReading]) -> bool:
        trigger = armed.fault.trigger
        if trigger.kind is TriggerKind.TIME:
            return now - self._started >= trigger.at
        if trigger.kind is TriggerKind.EVERY:
            return self._running_s >= armed.due
        if trigger.kind is TriggerKind.STEP:
            return slot is not None and slot.beats > 0 and slot.step >= trigger.at
        return True  # SAVE, COMMIT: the request waits in the slot for the save


_WORKER_SIDE = {FaultKind.RAISE: c.CHAOS_RAISE, FaultKind.SLEEP: c.CHAOS_SLEEP, FaultKind.SLOW: c.CHAOS_SLOW}
_POINTS = {TriggerKind.SAVE: c.CHAOS_AT_SAVE, TriggerKind.COMMIT: c.CHAOS_AT_COMMIT}


def _request_word(fault: Fault, sequence: int) -> int:
    """0 for a signal the supervisor sends itself; else the slot word worker_lib acts on."""
    point = _POINTS.get(fault.trigger.kind)
    if point is None and fault.kind not in _WORKER_SIDE:
        return 0
    action = _WORKER_SIDE.get(fault.kind, fault.kind.signum)
    factor = round(fault.factor * 100) << c.CHAOS_FACTOR_SHIFT  # slow's; 0 for the others
    return factor | (sequence << 16) | ((point or c.CHAOS_AT_BEAT) << 8) | action


def mark_injected(failures: List[Failure], injected: List[Injection]) -> List[Failure]:
    """A failure of a process --chaos sent a fault to is the fault's doing (the signal's death,
    a hang, an error exit); anything else, a peer's broken collective, keeps its own cause."""
    sent = {
        (i.rank, i.pid): i.signum for i in injected if i.kind != FaultKind.SLOW.value
    }  # slow fails nothing
    return [
        dataclasses.replace(f, injected=True) if isinstance(f, _MARKABLE) and _caused(f, sent) else f
        for f in failures
    ]


def not_landed(failures: List[Failure], injected: List[Injection]) -> List[Injection]:
    """The requests left for worker_lib that caused none of ``failures`` (marked already)."""
    landed = {(f.rank, f.pid) for f in failures if isinstance(f, _MARKABLE) and f.injected}
    # a slow rank fails nothing: its request is carried out at its next beat, and said there
    slow = FaultKind.SLOW.value
    return [i for i in injected if i.request and i.kind != slow and (i.rank, i.pid) not in landed]


def _caused(f: Failure, sent: dict) -> bool:
    key = (f.rank, getattr(f, "pid", None))
    if key not in sent:
        return False
    signum = sent[key]
    if isinstance(f, HangFailure):
        return signum in (signal.SIGSTOP, 0)  # stopped, or (sleep) asleep
    if signum == 0:  # an exception: the rank exits with an error of its own making
        return isinstance(f, ProcessFailure) and f.exitcode > 0
    return isinstance(f, ProcessFailure) and f.exitcode == -signum
