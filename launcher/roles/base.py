"""The node's role: what differs between the only node, node 0 of many (the leader) and any other
node (a follower), behind one interface the attempt loop and the attempt runner use. Chosen once,
when the supervisor starts (``supervisor._role``)."""

import abc
import dataclasses
from typing import List, Optional, Tuple, TypeVar

from launcher.cluster.wire import Interrupt, InterruptKind, JobVerdict
from launcher.core.beats import ProgressRow
from launcher.core.layout import Layout
from launcher.core.results import AttemptResult, RunResult
from launcher.core.stopping import StopReading
from launcher.grammar.errors import FtlaunchError

__all__ = ["AttemptPlan", "Conclusion", "Role", "in_attempt"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class AttemptPlan:
    """What this node needs to start its ranks: the attempt's number, the workers' store, and
    which ranks are this node's."""

    attempt: int
    master_addr: str
    master_port: int
    layout: Layout


def in_attempt(value: Optional[T], what: str) -> T:
    """What a role holds only from ``meet`` to ``conclude`` (the attempt's channel, layout, store):
    asked for outside, it is a defect of the loop, said as one."""
    if value is None:
        raise RuntimeError(f"the role's {what} is asked for with no attempt in progress")
    return value


@dataclasses.dataclass(frozen=True)
class Conclusion:
    """An attempt concluded: the job's result of it, and node 0's verdict where this node takes
    it from node 0 (a follower; None where this node decides itself)."""

    result: AttemptResult
    verdict: Optional[JobVerdict] = None


class Role(abc.ABC):
    """One node's part in the run. Between attempts: ``meet`` the others and plan the attempt,
    ``conclude`` it (this node's result → the job's), ``decide`` how the run goes on and
    ``announce`` the decision to the other nodes (node 0). During an
    attempt (asked by the runner): ``interrupt`` the other nodes, ``tick`` for their news,
    ``agree_stop_step``, ``publish_progress``, ``keep_alive``."""

    progress_every_s: float = 5.0  # how often the live ranks' steps are published

    # -- between attempts ------------------------------------------------------------------------

    @abc.abstractmethod
    def meet(self) -> AttemptPlan:
        """Plan the next attempt (with the other nodes). SignalReceived or JoinTimeout end the run."""

    def may_restart(self, local: AttemptResult) -> bool:
        """Whether a restart may follow this node's attempt as it ends (before its group stops):
        what is made ahead for a restart is otherwise wasted. By default: as its outcome most
        often is; a node that holds the policy asks it."""
        return local.outcome.may_restart

    @abc.abstractmethod
    def conclude(self, local: AttemptResult) -> Conclusion:
        """The attempt's result for the job, from this node's (and the other nodes' reports), and
        all ``decide`` needs."""

    @abc.abstractmethod
    def decide(
        self, concluded: Conclusion, attempts: List[AttemptResult]
    ) -> Tuple[Optional[RunResult], float]:
        """How the run ends after the attempt, or (None, delay): restart after ``delay`` seconds."""

    def announce(  # noqa: B027 - a hook; by default nothing
        self, concluded: Conclusion, ended: Optional[RunResult], delay: float
    ) -> None:
        """Tell the other nodes what ``decide`` decided (node 0 alone has nodes to tell)."""

    @abc.abstractmethod
    def not_started(self, error: Exception) -> None:
        """The attempt's workers could not be started: the run ends with ``error``."""

    @abc.abstractmethod
    def ended_waiting(self, error: FtlaunchError, attempts: List[AttemptResult]) -> RunResult:
        """A signal or --join-timeout while meeting: the run ends (and can be resumed)."""

    @abc.abstractmethod
    def pause(self, seconds: float) -> None:
        """Wait between attempts; a signal ends the wait."""

    # -- during an attempt -------------------------------------------------------------------

    def interrupt(self, kind: InterruptKind, detail: str, signum: Optional[int] = None) -> None:  # noqa: B027 - a hook; by default nothing
        """This node's attempt ends (a failure, a hang, a signal): the other nodes' too."""

    def tick(self) -> Optional[Interrupt]:
        """Another node's interrupt (or a lost node's), once there is one."""
        return None

    @abc.abstractmethod
    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        """The step every rank stops at, from this node's ranks' ``reading`` (None: it has no
        running rank) and the other nodes'; 0: none is asked."""

    @abc.abstractmethod
    def publish_progress(self, attempt: int, rows: List[ProgressRow]) -> None:
        """The live ranks' steps, for ``ftlaunch status``."""

    def keep_alive(self) -> None:  # noqa: B027 - a hook; by default nothing
        """Called often while workers start and run: the run's lease, where this node holds it."""

    def group_running(self) -> None:  # noqa: B027 - a hook; by default nothing
        """The attempt's workers all started."""

    def close(self) -> None:  # noqa: B027 - a hook; by default nothing
        """The run is over."""
