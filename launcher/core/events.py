"""The run's event log, and every event in it as a typed definition.

Emitters (the supervisor, the hang monitor, the run) build these records; readers (recovery
phases, goodput, tests, benchmarks) get the same records back, so a field is named in one place.
On disk each event is one JSON line: ``{"event": KIND, "t_mono": …, "t_wall": …, field: value …}``.
Monotonic times are what phases are measured with (they never jump); wall-clock time is only for
people reading the log.
"""

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    Generic,
    Iterable,
    Iterator,
    List,
    Optional,
    TextIO,
    Type,
    TypeVar,
    Union,
    cast,
    get_args,
)

from launcher.core.beats import Phase
from launcher.core.checked import SMALLEST_INT, check_fields
from launcher.core.group_state import GroupState

__all__ = [
    "AttemptEnded",
    "AttemptPlanned",
    "ChaosInjected",
    "CheckpointLoaded",
    "CheckpointTotals",
    "Decision",
    "Event",
    "EventLog",
    "Say",
    "first_of",
    "of_kind",
    "FirstStep",
    "GroupsGuarded",
    "GuardRestarted",
    "Hang",
    "HealthChecked",
    "HeartbeatDeadline",
    "InternalError",
    "KeptTime",
    "Laggard",
    "Straggler",
    "OwnWorkNoted",
    "Logged",
    "NodeReplaced",
    "NodesMet",
    "RoundAbandoned",
    "PeerInterrupt",
    "Resume",
    "RunEnd",
    "RunStart",
    "StandbyLost",
    "CopyRestored",
    "CopiesNoted",
    "Steps",
    "StopRequested",
    "Takeover",
    "Transition",
    "WorkerExit",
    "parse_logged",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunStart:
    KIND: ClassVar[str] = "run_start"
    run_id: str
    config: Dict[str, Any]
    pid: int


@dataclasses.dataclass(frozen=True)
class Transition:
    """One step of an attempt's GroupStateMachine; the optional fields belong to some states."""

    KIND: ClassVar[str] = "transition"
    attempt: int
    old: Optional[GroupState]
    new: GroupState
    failed_at: Optional[float] = None  # FAILED, HUNG: monotonic time of the failure itself
    root_cause: Optional[str] = None  # FAILED: the root cause, in one line
    error: Optional[str] = None  # FAILED: the workers could not be started
    pids: Optional[List[int]] = None  # RUNNING
    ranks: Optional[List[int]] = None  # HUNG: the ranks past their deadline
    killed: Optional[bool] = None  # STOPPED: SIGKILL was needed
    seconds: Optional[float] = None  # STOPPED: how long the stop took
    survivors: Optional[List[int]] = None  # STOPPED: pids that could not be stopped


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    KIND: ClassVar[str] = "worker_exit"
    attempt: int
    rank: int
    pid: int
    exitcode: int
    t_observed: float  # monotonic: when the supervisor saw it


@dataclasses.dataclass(frozen=True)
class Decision:
    """The restart policy's verdict after a failed attempt (or a change of an elastic job's nodes)."""

    KIND: ClassVar[str] = "decision"
    attempt: int
    verdict: str  # a policy.Verdict value, "resize" (elastic: the nodes changed), "node_lost", "replace"
    reason: str
    delay: float


@dataclasses.dataclass(frozen=True)
class StopRequested:
    KIND: ClassVar[str] = "stop_requested"
    attempt: int
    at_step: int


@dataclasses.dataclass(frozen=True)
class Hang:
    """A rank past its heartbeat deadline."""

    KIND: ClassVar[str] = "hang"
    attempt: int
    rank: int
    phase: Phase
    silent_for: float
    deadline: float
    last_step: int  # -1: it never said
    silent_since: float  # monotonic time of its last sign of life (stalled: of its last new step)
    stalled: bool = False  # it beats, at the same step since silent_since


@dataclasses.dataclass(frozen=True)
class Laggard(Hang):
    """A rank silent for over half its deadline (not yet hung)."""

    KIND: ClassVar[str] = "laggard"


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A rank named slow: its own work (its step without the wait for the others) ``ratio``
    times the median of the other ranks' over the window; ``back``: it is no longer."""

    KIND: ClassVar[str] = "straggler"
    attempt: int
    rank: int
    node: Optional[int]  # None: the only node
    host: str
    ratio: float
    window: float  # seconds the own work was averaged over
    back: bool = False


@dataclasses.dataclass(frozen=True)
class OwnWorkNoted:
    """Each measured rank's own work a step against the median of the others' (rank as text,
    as JSON keys are), where the run is held: every 15 s at first, then every minute at most."""

    KIND: ClassVar[str] = "own_work_noted"
    attempt: int
    ratios: Dict[str, float]


@dataclasses.dataclass(frozen=True)
class HeartbeatDeadline:
    """The auto deadline was learned, or moved."""

    KIND: ClassVar[str] = "heartbeat_deadline"
    attempt: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class CheckpointLoaded:
    """Every rank's checkpoint load has returned."""

    KIND: ClassVar[str] = "checkpoint_loaded"
    attempt: int
    t_done: float  # monotonic, the workers' own reading: when the last rank's load returned
    step: Optional[int] = None  # the step they loaded (None: none, or not one step)
    tier: str = ""  # where from: "memory", "storage"; "": nothing loaded, or not known


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """Every rank of the attempt has beaten: a recovery ends here."""

    KIND: ClassVar[str] = "first_step"
    attempt: int


@dataclasses.dataclass(frozen=True)
class Takeover:
    KIND: ClassVar[str] = "takeover"
    previous: str  # the holder taken over from, described
    why: str  # "dead" or "lease expired"


@dataclasses.dataclass(frozen=True)
class Resume:
    KIND: ClassVar[str] = "resume"
    previous_status: str  # a RunStatus value
    attempts: int


@dataclasses.dataclass(frozen=True)
class GroupsGuarded:
    """Descendants of the workers made process groups of their own (setsid): the orphan guard
    watches those groups too."""

    KIND: ClassVar[str] = "groups_guarded"
    attempt: int
    pgids: List[int]


@dataclasses.dataclass(frozen=True)
class GuardRestarted:
    """The orphan guard died and a new one watches the workers' groups."""

    KIND: ClassVar[str] = "orphan_guard_restarted"
    dead_pid: int
    new_pid: int


@dataclasses.dataclass(frozen=True)
class NodesMet:
    """Many nodes: every node joined the attempt's rendezvous round."""

    KIND: ClassVar[str] = "nodes_met"
    attempt: int  # -1 on a node that learns the number from node 0 afterwards
    nnodes: int
    waited: float  # seconds in the rendezvous
    new_round: bool = True  # False: a restart of the same nodes kept the previous round
    nodes: Optional[List[int]] = None  # the training nodes, in position order
    standby: Optional[List[int]] = None  # --standby-nodes: the round's nodes that stand by


@dataclasses.dataclass(frozen=True)
class NodeReplaced:
    """--standby-nodes, node 0: a standby took a lost node's position (its GROUP_RANK and RANKs)."""

    KIND: ClassVar[str] = "node_replaced"
    attempt: int  # the attempt the standby trains in
    position: int  # GROUP_RANK
    node: int  # the node that took it
    replaced: int  # the node that held it
    why: str  # why that node left


@dataclasses.dataclass(frozen=True)
class StandbyLost:
    """--standby-nodes, node 0: a standby node was found lost during an attempt (which goes on)."""

    KIND: ClassVar[str] = "standby_lost"
    attempt: int
    node: int
    why: str
    left: int  # standby nodes still there


@dataclasses.dataclass(frozen=True)
class CopyRestored:
    """--memory-peers: this node's ranks held no snapshot of their own (a standby that took a
    place, a node relaunched), and got one from another node's copy before they started."""

    KIND: ClassVar[str] = "copy_restored"
    attempt: int
    step: int
    ranks: List[int]
    holder: int  # the node that held the copy
    source: int  # the node that sent it
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class CopiesNoted:
    """--memory-peers: how far this node's copies on other nodes are, when that changed (noted
    with the progress, every 5 s at most)."""

    KIND: ClassVar[str] = "copies_noted"
    attempt: int
    newest: int  # the newest step every rank of this node holds (-1: none)
    copied: int  # the newest step every one of its peers holds of it (-1: none)
    sent: int  # bytes sent for copies since the supervisor started


@dataclasses.dataclass(frozen=True)
class RoundAbandoned:
    """Many nodes, node 0: a node of the rendezvous round never announced itself (its supervisor
    died on the way); no attempt ran on the round, every node met again."""

    KIND: ClassVar[str] = "round_abandoned"
    nnodes: int  # the round's size, which the job would have had
    reason: str


@dataclasses.dataclass(frozen=True)
class PeerInterrupt:
    """Many nodes: another node stopped the attempt (a failure, a hang, a lost node, a signal)."""

    KIND: ClassVar[str] = "peer_interrupt"
    attempt: int
    node: int
    kind: str  # "failure", "stop" or "lost"
    detail: str


@dataclasses.dataclass(frozen=True)
class ChaosInjected:
    """--chaos sent a fault to a worker."""

    KIND: ClassVar[str] = "chaos_injected"
    attempt: int
    fault: str  # the fault's clause, e.g. "kill:rank=random,every=30s"
    signal: str  # e.g. "SIGKILL"; "raise" or "sleep" for worker_lib's
    rank: int
    pid: int
    step: Optional[int] = None  # the rank's heartbeat step then; None: it never beat
    via: str = "signal"  # "signal": sent now; "worker_lib": asked through the slot, done there


@dataclasses.dataclass(frozen=True)
class AttemptPlanned:
    """The attempt's size, as this node starts its share of it."""

    KIND: ClassVar[str] = "attempt_planned"
    attempt: int
    world_size: int
    nodes: List[int]  # the node ranks that hold the attempt
    ranks: List[int]  # this node's global ranks


@dataclasses.dataclass(frozen=True)
class Steps:
    """This node's ranks' progress, as their heartbeat slots say it: when all have first beaten,
    then every 5 to 15 s while the step moves (``observe.slots``), and when the attempt is over."""

    KIND: ClassVar[str] = "steps"
    attempt: int
    step: int  # the newest step every one of this node's ranks has reported (the slowest rank's)
    furthest: int  # the furthest rank's
    reported_at: float  # monotonic: the slowest rank's last sign of life, on its own clock


@dataclasses.dataclass(frozen=True)
class CheckpointTotals:
    """What this node's ranks have counted of their checkpoints in this attempt so far (worker_lib's
    counters in the heartbeat slots, summed over the ranks): saves per tier and the seconds the
    training loop spent in them, commits (the job's rank 0 writes every commit marker) and the
    seconds from each save's call to its marker, loads per tier and the seconds they took."""

    KIND: ClassVar[str] = "checkpoint_totals"
    attempt: int
    saves_memory: int = 0
    save_memory_s: float = 0.0
    saves_storage: int = 0
    save_storage_s: float = 0.0
    commits: int = 0
    commit_s: float = 0.0
    loads_memory: int = 0
    load_memory_s: float = 0.0
    loads_storage: int = 0
    load_storage_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class AttemptEnded:
    """How the attempt ended for the job (every node's reports merged) and whether the run goes on."""

    KIND: ClassVar[str] = "attempt_ended"
    attempt: int
    outcome: str  # an AttemptOutcome value
    cause: str = ""  # FAILED: "crash", "hang", "lost_node" or "unknown" (not described); else ""
    rank: Optional[int] = None  # the root cause's rank (-1: a whole node)
    node: Optional[int] = None  # the root cause's node, with many nodes
    injected: bool = False  # --chaos caused it
    restarting: bool = False  # another attempt follows


@dataclasses.dataclass(frozen=True)
class KeptTime:
    """Goodput's numerator, written by the node that holds the run at each attempt's start and
    end: the run's wall time spent on steps that were kept, over its ended attempts (earlier
    supervisors' included; None: unknown), and when the run's first attempt started."""

    KIND: ClassVar[str] = "kept_time"
    seconds: Optional[float]
    since: float  # wall clock
    in_progress: bool = False  # an attempt starts: its stepping counts as kept while it runs


@dataclasses.dataclass(frozen=True)
class HealthChecked:
    """This node's health check before an attempt (``agent.health``): which checks passed, which
    could not be known here, and the one that failed (the node then leaves: exit 8)."""

    KIND: ClassVar[str] = "health_checked"
    before: str  # "start" (the node's first attempt) or "restart"
    healthy: bool
    passed: List[str]
    unknown: List[str]
    failed: str = ""  # the check that failed ("--health-check", "checkpoint storage", "gpu 0"...)
    detail: str = ""  # why, with the command's last lines of output
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class InternalError:
    """A defect in ftlaunch itself stopped the attempt: written before anything else is cleaned
    up, so the run dir keeps the evidence even if the rest of the way out goes wrong."""

    KIND: ClassVar[str] = "internal_error"
    attempt: int
    error: str  # e.g. "KeyError: 'x'"
    traceback: str


@dataclasses.dataclass(frozen=True)
class RunEnd:
    KIND: ClassVar[str] = "run_end"
    exit_code: int
    reason: str


Event = Union[
    RunStart,
    Transition,
    WorkerExit,
    Decision,
    StopRequested,
    Hang,
    Laggard,
    Straggler,
    OwnWorkNoted,
    HeartbeatDeadline,
    CheckpointLoaded,
    FirstStep,
    Takeover,
    Resume,
    GuardRestarted,
    GroupsGuarded,
    NodesMet,
    NodeReplaced,
    StandbyLost,
    CopyRestored,
    CopiesNoted,
    RoundAbandoned,
    PeerInterrupt,
    ChaosInjected,
    AttemptPlanned,
    Steps,
    CheckpointTotals,
    AttemptEnded,
    KeptTime,
    HealthChecked,
    InternalError,
    RunEnd,
]

_KINDS: Dict[str, Type] = {cls.KIND: cls for cls in get_args(Event)}
# Fields read back as enums rather than as the strings JSON holds.
_ENUM_FIELDS: Dict[str, Type] = {"old": GroupState, "new": GroupState, "phase": Phase}


E = TypeVar("E")
# A line for the user (the console's ``say``): what every part that speaks is handed.
Say = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Logged(Generic[E]):
    """An event as the log holds it: when it happened, on both clocks. ``Logged[Transition]``: one
    whose event is known to be a Transition (``of_kind`` finds them)."""

    event: E
    t_mono: float
    t_wall: float

    @property
    def attempt(self) -> Optional[int]:
        return getattr(self.event, "attempt", None)

    def to_json(self) -> Dict[str, Any]:
        event: Any = self.event
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        return {"event": event.KIND, "t_mono": self.t_mono, "t_wall": self.t_wall, **fields}


def of_kind(log: Iterable[Logged[Any]], kind: Type[E]) -> Iterator[Logged[E]]:
    """The events of ``kind``, typed as such, in the log's order."""
    for logged in log:
        if isinstance(logged.event, kind):
            yield cast("Logged[E]", logged)


def first_of(log: Iterable[Logged[Any]], kind: Type[E], attempt: Optional[int] = None) -> Optional[Logged[E]]:
    """The first event of ``kind`` (of ``attempt``, when given); None when there is none."""
    return next((e for e in of_kind(log, kind) if attempt is None or e.attempt == attempt), None)


def parse_logged(line: Dict[str, Any]) -> Optional[Logged[Event]]:
    """A line of events.jsonl back as a typed event; None for a kind or shape this version does
    not know (a line from another version of ftlaunch is skipped, not fatal), or for values no
    supervisor writes."""
    cls = _KINDS.get(str(line.get("event"))) if isinstance(line, dict) else None
    if cls is None:
        return None
    try:
        given = {f.name: line[f.name] for f in dataclasses.fields(cls) if f.name in line}
        # as run.json's: no NaN, no 1e308, no int past int64 (ints may be -1: a whole node, a signal)
        check_fields(cls, given, ints_from=SMALLEST_INT)
        check_fields(Logged, {"t_mono": line["t_mono"], "t_wall": line["t_wall"]})
        fields = {name: _typed(name, value) for name, value in given.items()}
        return Logged(cls(**fields), float(line["t_mono"]), float(line["t_wall"]))
    except (KeyError, TypeError, ValueError):
        return None


def _typed(name: str, value: Any) -> Any:
    enum_type = _ENUM_FIELDS.get(name)
    return enum_type(value) if enum_type is not None and value is not None else value


class EventLog:
    """Appends events to ``path`` and keeps them in memory for the run summary."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.logged: List[Logged[Event]] = []
        self._lock = threading.Lock()
        self._file: Optional[TextIO] = open(path, "a", encoding="utf-8")

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def emit(self, event: Event) -> Logged[Event]:
        logged = Logged(event, time.monotonic(), time.time())
        line = json.dumps(logged.to_json(), default=str)
        with self._lock:
            self.logged.append(logged)
            self._append(line)
        log.debug("event %s", line)
        return logged

    def since(self, index: int) -> List[Logged[Event]]:
        """The events after the first ``index``, for a reader on another thread (the metrics
        exporter): a slice of a list that is only ever appended to, taken without the lock, so
        the emitting thread never waits for a reader."""
        return self.logged[index:]

    def _append(self, line: str) -> None:
        """A write error (a full disk) must not end the run: the events stay in memory and reach
        the run dir's events.jsonl with run.json; this file is not written to again."""
        file = self._file
        if file is None:
            return
        try:
            file.write(line + "\n")
            file.flush()
        except OSError as err:
            log.warning("cannot write %s (%s); its later events are kept with run.json only", self.path, err)
            self._file, broken = None, file
            try:
                broken.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None
