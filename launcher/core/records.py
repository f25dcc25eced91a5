"""What run.json holds: the run's state, its attempts and their failures. Plain records that
serialize to JSON (enums by value) and load back typed; ``runs.run`` decides what goes in."""

import dataclasses
import enum
import json
from typing import Any, Dict, List, Optional, Sequence

from launcher.core.checked import check_fields
from launcher.core.evidence import Progress
from launcher.core.failures import Failure, HangFailure, NodeLostFailure
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.policy import AttemptRecord

__all__ = ["AttemptEntry", "FailureCause", "FailureEntry", "RunState", "kept_seconds"]


class FailureCause(str, enum.Enum):
    EXIT = "exit"  # a non-zero exit code
    SIGNAL = "signal"  # killed by a signal
    EXCEPTION = "exception"  # an uncaught exception that @record wrote down
    HANG = "hang"  # a missed heartbeat deadline
    NODE_LOST = "node_lost"  # a node's supervisor stopped answering


@dataclasses.dataclass
class FailureEntry:
    rank: int  # -1: a whole node
    cause: FailureCause
    detail: str  # the failure's one-line description
    at: float  # wall clock
    node: Optional[int] = None  # in a job of many nodes
    injected: bool = False  # --chaos caused it

    @classmethod
    def of(cls, failure: Failure, at: float) -> "FailureEntry":
        if isinstance(failure, NodeLostFailure):
            cause = FailureCause.NODE_LOST
        elif isinstance(failure, HangFailure):
            cause = FailureCause.HANG
        elif failure.error is not None:
            cause = FailureCause.EXCEPTION
        else:
            cause = FailureCause.SIGNAL if failure.exitcode < 0 else FailureCause.EXIT
        injected = getattr(failure, "injected", False)
        return cls(failure.rank, cause, failure.describe(), at, failure.node, injected)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "FailureEntry":
        _check_fields(cls, data)
        return cls(**{**data, "cause": FailureCause(data["cause"])})


@dataclasses.dataclass
class AttemptEntry:
    attempt: int
    started_at: float  # wall clock
    host: str
    supervisor_pid: int
    resumed_from_step: Optional[int] = None  # newest committed step when it started
    ended_at: Optional[float] = None
    outcome: Optional[AttemptOutcome] = None  # None: running, or its supervisor has not come back
    newest_step_at_end: Optional[int] = None
    newest_step_committed_at: Optional[float] = None  # wall clock
    checkpoints_seen: bool = False  # the checkpoint dir could be listed at its end
    first_step_at: Optional[float] = None  # wall clock: every rank had beaten (needs heartbeats)
    beat: bool = False  # some rank called ft.heartbeat()
    furthest_step: Optional[int] = None  # the highest step a rank beat with
    progress: Progress = Progress.UNKNOWN  # judged from the evidence when it ended
    progress_evidence: str = ""  # that evidence, in words
    failures: List[FailureEntry] = dataclasses.field(default_factory=list)
    nodes: List[Dict[str, Any]] = dataclasses.field(default_factory=list)  # many nodes: node, host, pid
    injected: bool = False  # its root cause was a fault --chaos injected
    world_size: Optional[int] = None  # its ranks, every node's (None: written before it was kept)
    resize: str = ""  # --nnodes MIN:MAX: it runs on other nodes than the attempt before, and why
    replaced: str = ""  # --standby-nodes: which standby took which lost node's place, and why
    blamed_node: Optional[int] = None  # many nodes: the root cause's node, where the blame is sure

    @property
    def committed_new(self) -> bool:
        """It committed a newer checkpoint than the one it started from."""
        return self.checkpoints_seen and self.newest_step_at_end not in (None, self.resumed_from_step)

    def record(self) -> AttemptRecord:
        progressed = {Progress.MADE: True, Progress.NONE: False}.get(self.progress)
        return AttemptRecord(
            self.attempt, self.outcome, self.ended_at or 0.0, progressed, self.injected, self.blamed_node
        )

    def kept(self, now: float) -> float:
        """Wall seconds of it spent stepping towards what was kept: a succeeded (or running)
        attempt's whole run, another one's until its newest commit; start-up is not stepping."""
        end = self.ended_at if self.ended_at is not None else now
        if self.outcome is None:  # running: nothing is known to be stepping before its first step
            return max(0.0, end - self.first_step_at) if self.first_step_at is not None else 0.0
        stepping_from = self.first_step_at or self.started_at  # a script that never beats
        if self.outcome is AttemptOutcome.SUCCEEDED:
            return max(0.0, end - stepping_from)
        if self.committed_new and self.newest_step_committed_at is not None:
            return max(0.0, min(end, self.newest_step_committed_at) - stepping_from)
        return 0.0

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "AttemptEntry":
        _check_fields(cls, data)
        for node in data.get("nodes", []):
            _check_fields(_NodeEntry, node)
        outcome = data.get("outcome")
        return cls(
            **{
                **data,
                "outcome": AttemptOutcome(outcome) if outcome is not None else None,
                "progress": Progress(data.get("progress", Progress.UNKNOWN)),
                "failures": [FailureEntry.from_json(f) for f in data.get("failures", [])],
            }
        )


@dataclasses.dataclass
class RunState:
    name: str
    url: str
    status: RunStatus
    created_at: float
    config: Dict[str, Any]
    attempts: List[AttemptEntry] = dataclasses.field(default_factory=list)
    budget_from: int = 0  # the first attempt the failure budget counts (a human relaunch resets it)
    takeovers: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    latest_step: Optional[int] = None
    latest_step_at: Optional[float] = None  # wall clock of its commit
    reason: str = ""
    exit_code: Optional[int] = None
    updated_at: float = 0.0
    user: Optional[str] = None  # who started it (None: a run.json older than this field)

    def history(self) -> List[AttemptRecord]:
        """The finished attempts the failure budget counts, oldest first."""
        return [a.record() for a in self.attempts[self.budget_from :] if a.outcome is not None]

    @property
    def next_attempt(self) -> int:
        return len(self.attempts)

    def count(self, outcome: AttemptOutcome) -> int:
        return sum(a.outcome is outcome for a in self.attempts)

    def to_json(self) -> Dict[str, Any]:
        """Plain JSON types: enums become their values."""
        plain: Dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        return plain

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "RunState":
        """Raises ValueError, TypeError or KeyError for anything that is not a run's state: a
        field of the wrong type, a number out of its range, NaN, a time that is no date."""
        _check_fields(cls, data)
        _check_fields(_RecordedConfig, data.get("config", {}))
        attempts = [AttemptEntry.from_json(a) for a in data.get("attempts", [])]
        return cls(**{**data, "status": RunStatus(data["status"]), "attempts": attempts})


def kept_seconds(attempts: Sequence[AttemptEntry], now: float) -> Optional[float]:
    """The wall seconds of ``attempts`` spent on kept steps (goodput's numerator); None (unknown)
    when ftlaunch saw no step of them (no rank beat, no worker_lib commit: ``/bin/echo`` took none,
    a training script took steps unseen), or when one ended without success and the script
    commits no checkpoint ftlaunch can see: what such an attempt kept is not known."""
    script_commits = any(a.newest_step_at_end is not None for a in attempts)
    if attempts and not script_commits and not any(a.beat for a in attempts):
        return None
    done = (AttemptOutcome.SUCCEEDED, None)
    if not script_commits and any(a.outcome not in done for a in attempts):
        return None
    return float(sum(a.kept(now) for a in attempts))


# A failure's rank -1: a whole node; every other int of run.json is 0 or more.
_LOWEST = {"rank": -1}


@dataclasses.dataclass
class _RecordedConfig:
    """The fields of ``RunState.config`` (``LaunchConfig.to_json``) that a reader of run.json uses
    (`status`, a relaunch comparing commands); older files may lack any of them."""

    entry_kind: Optional[str]
    entrypoint: Optional[str]
    script_args: Optional[List[str]]
    nproc: Optional[int]
    nnodes: Optional[int]
    checkpoint_url: Optional[str]
    log_dir: Optional[str]
    chaos: Optional[str]


@dataclasses.dataclass
class _NodeEntry:
    """An entry of ``AttemptEntry.nodes`` (kept as a plain dict there)."""

    node: int
    host: str
    pid: int
    position: Optional[int] = None  # --standby-nodes: its GROUP_RANK (None: it stood by, or older)
    standby: bool = False  # --standby-nodes: it stood by in the attempt, running no rank


def _check_fields(cls: type, data: Any) -> None:
    check_fields(cls, data, _LOWEST)
