"""What run.json holds: the run's state, its attempts and their failures. Plain records that
serialize to JSON and back; the transitions of the run's status are checked here."""

import dataclasses
import enum
from typing import Any, Dict, List, Optional

from launcher.failures import Failure, HangFailure
from launcher.policy import AttemptOutcome, AttemptRecord

__all__ = ["AttemptEntry", "FailureEntry", "RunState", "RunStatus"]


class RunStatus(str, enum.Enum):
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # budget spent, or a crash loop
    STOPPED = "STOPPED"  # interrupted (SIGINT, SIGHUP)
    PREEMPTED = "PREEMPTED"  # SIGTERM: relaunch to resume


@dataclasses.dataclass
class FailureEntry:
    rank: int
    cause: str  # "exit", "signal", "exception" or "hang"
    detail: str  # the failure's one-line description
    at: float  # wall clock

    @classmethod
    def of(cls, failure: Failure, at: float) -> "FailureEntry":
        if isinstance(failure, HangFailure):
            cause = "hang"
        elif failure.error is not None:
            cause = "exception"
        else:
            cause = "signal" if failure.exitcode < 0 else "exit"
        return cls(failure.rank, cause, failure.describe(), at)


@dataclasses.dataclass
class AttemptEntry:
    attempt: int
    started_at: float  # wall clock
    host: str
    supervisor_pid: int
    resumed_from_step: Optional[int] = None  # newest committed step when it started
    ended_at: Optional[float] = None
    outcome: Optional[str] = None  # an AttemptOutcome value
    newest_step_at_end: Optional[int] = None
    newest_step_committed_at: Optional[float] = None  # wall clock
    checkpoints_seen: bool = False  # the checkpoint dir could be listed at its end
    first_step_at: Optional[float] = None  # wall clock: every rank had beaten (needs heartbeats)
    failures: List[FailureEntry] = dataclasses.field(default_factory=list)

    @property
    def progressed(self) -> Optional[bool]:
        """Committed a newer checkpoint than it started from; None where checkpoints are unseen."""
        if not self.checkpoints_seen:
            return None
        return self.newest_step_at_end != self.resumed_from_step

    def record(self) -> AttemptRecord:
        return AttemptRecord(
            self.attempt, AttemptOutcome(self.outcome), self.ended_at or 0.0, self.progressed
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

    def history(self) -> List[AttemptRecord]:
        """The finished attempts the failure budget counts, oldest first."""
        return [a.record() for a in self.attempts[self.budget_from :] if a.outcome is not None]

    @property
    def next_attempt(self) -> int:
        return len(self.attempts)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "RunState":
        attempts = []
        for a in data.get("attempts", []):
            failures = [FailureEntry(**f) for f in a.get("failures", [])]
            attempts.append(AttemptEntry(**{**a, "failures": failures}))
        return cls(**{**data, "status": RunStatus(data["status"]), "attempts": attempts})
