"""How one attempt and one run ended, as the loop hands them on: records shared by the roles,
the summary and the CLI (below all of them, above only the failure records)."""

import dataclasses
import signal
from typing import TYPE_CHECKING, Dict, List, Optional

from launcher.core.beats import BeatSummary, Entered
from launcher.core.failures import Failure, root_cause
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.grammar.errors import CheckStopped, PeerStopped, SignalReceived, exit_code_for_signal

if TYPE_CHECKING:  # the records are filled in by the loop; recovery sits above this module
    from launcher.core.recovery import Recovery

__all__ = ["AttemptResult", "RunResult"]


@dataclasses.dataclass(frozen=True)
class AttemptResult:
    attempt: int
    outcome: AttemptOutcome  # SUPERVISOR_LOST only on a follower that lost node 0 during it
    failures: List[Failure] = dataclasses.field(default_factory=list)
    signum: Optional[int] = None  # when stopped by a signal
    signal_name: str = ""  # that signal as the node that received it names it (the notice: SIGUSR1)
    lived: float = 0.0  # seconds from its start until the supervisor saw it end
    beats: BeatSummary = BeatSummary(beat=False, furthest_step=None)
    cause: str = ""  # many nodes: why this node's ranks were stopped, when another node said so
    resize: str = ""  # node 0 of an elastic job: it ran on other nodes than the attempt before, and why
    replaced: str = ""  # node 0, --standby-nodes: which standby took which lost node's place, and why
    restored: str = ""  # --memory-peers: whose ranks' snapshots came from another node's copy
    # rank → the last collective it entered, where known: a hang's culprit is read from every
    # node's ranks' (launcher.hangs.culprit)
    collectives: Dict[int, Entered] = dataclasses.field(default_factory=dict)
    culprit: str = ""  # a hang's: who never entered the collective the others wait in

    @property
    def root_cause(self) -> Optional[Failure]:
        return root_cause(self.failures) if self.failures else None

    def describe_cause(self) -> str:
        cause = self.root_cause
        return cause.describe() if cause is not None else self.cause or "unknown"


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    status: RunStatus
    attempts: List[AttemptResult]
    reason: str
    recoveries: List["Recovery"] = dataclasses.field(default_factory=list)
    goodput: Optional[float] = None  # over the whole run, earlier supervisors included
    holds_run: bool = True  # False on a follower node: recoveries and goodput are node 0's to tell


def meeting_stopped(error: SignalReceived) -> str:
    """Where a signal that came while the nodes met stopped the job: here, or on another node."""
    if isinstance(error, CheckStopped):
        return "during this node's health check"
    where = f"on node {error.node} " if isinstance(error, PeerStopped) else ""
    return f"{where}while the nodes were meeting"


def ended_by_signal(
    signum: int, attempts: List[AttemptResult], while_: str = "", *, holds_run: bool = True, said_as: str = ""
) -> RunResult:
    """The one way a run ends for a signal: 128 + N, PREEMPTED for SIGTERM (STOPPED for the
    others), "interrupted by SIGTERM" and where (``while_``: "while the nodes were meeting").
    ``said_as``: the name the user knows it by (the preemption notice's, recorded as SIGTERM)."""
    status = RunStatus.ended_by(AttemptOutcome.stopped_by(signum))
    name = said_as or signal.Signals(signum).name
    reason = f"interrupted by {name}" + (f" {while_}" if while_ else "")
    return RunResult(exit_code_for_signal(signum), status, attempts, reason, holds_run=holds_run)
