"""What the agent's loop asks of this node's role: the only node, node 0 of many (the leader) or
any other node (a follower). Chosen once, when the agent starts. During an attempt the attempt
asks the role's ``link`` instead (``roles.link``)."""

import abc
import dataclasses
from typing import List, Optional, Tuple, TypeVar

from launcher.cluster.wire import JobVerdict
from launcher.core.layout import Layout
from launcher.core.results import AttemptResult, RunResult
from launcher.grammar.errors import FtlaunchError
from launcher.roles.link import PeerLink

__all__ = ["AttemptPlan", "Conclusion", "NodeRole", "in_attempt"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class AttemptPlan:
    """What this node needs to start its ranks: the attempt's number, the workers' store, and
    which ranks are this node's."""

    attempt: int
    master_addr: str
    master_port: int
    layout: Layout
    copies: Tuple[Tuple[int, str, str], ...] = ()  # (node, host, its copy server) of the round's nodes


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


class NodeRole(abc.ABC):
    """One node's part in the run, between attempts: ``meet`` the others and plan the attempt,
    ``conclude`` it (this node's result → the job's), ``decide`` how the run goes on and
    ``announce`` the decision to the other nodes (node 0)."""

    @abc.abstractmethod
    def meet(self) -> AttemptPlan:
        """Plan the next attempt (with the other nodes). SignalReceived or JoinTimeout end the run."""

    @property
    @abc.abstractmethod
    def link(self) -> PeerLink:
        """What the attempt planned by ``meet`` asks of the other nodes, until ``conclude``."""

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

    def close(self) -> None:  # noqa: B027 - a hook; by default nothing
        """The run is over."""
