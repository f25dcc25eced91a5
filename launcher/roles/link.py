"""What an attempt asks of this node's link to the other nodes while its ranks run: ``interrupt``
them, ``tick`` for their news, ``agree_stop_step``, ``publish_progress``, ``keep_alive``. One per
attempt, made by the role when it plans the attempt (``NodeRole.link``)."""

import abc
import dataclasses
import socket
import time
from typing import Callable, Dict, List, Optional

from launcher.cluster.follower_channel import FollowerChannel
from launcher.cluster.leader_channel import LeaderChannel
from launcher.cluster.rendezvous import Rendezvous
from launcher.cluster.wire import Interrupt, InterruptKind
from launcher.core.beats import CopyReading, ProgressRow
from launcher.core.events import StandbyLost
from launcher.core.results import AttemptResult
from launcher.core.stopping import StopReading, local_stop_step
from launcher.process.kit import NodeKit
from launcher.runs.run import Run

__all__ = ["FollowerLink", "JobRows", "LeaderLink", "PeerLink", "SingleLink"]


@dataclasses.dataclass(frozen=True)
class JobRows:
    """Every rank of the job as the node that holds the run last published them, and each node's
    host (None: the only node), for what is judged across the job (stragglers)."""

    ranks: List[ProgressRow]
    hosts: Dict[Optional[int], str]


# --nnodes MIN:MAX: how often node 0 asks the rendezvous whether a node waits to join.
_LOOK_FOR_JOINERS_S = 1.0


class PeerLink(abc.ABC):
    progress_every_s: float = 5.0  # how often the live ranks' steps are published

    def may_restart(self, local: AttemptResult) -> bool:
        """Whether a restart may follow this node's attempt as it ends (before its group stops):
        what is made ahead for a restart is otherwise wasted. By default: as its outcome most
        often is; a node that holds the policy asks it."""
        return local.outcome.may_restart

    def interrupt(self, kind: InterruptKind, detail: str, signum: Optional[int] = None) -> None:  # noqa: B027 - a hook; by default nothing
        """This node's attempt ends (a failure, a hang, a signal): the other nodes' too."""

    def tick(self) -> Optional[Interrupt]:
        """Another node's interrupt (or a lost node's), once there is one."""
        return None

    def decided(self) -> bool:
        """Node 0 has decided how the attempt ends (a standby's attempt ends with it)."""
        return False

    @abc.abstractmethod
    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        """The step every rank stops at, from this node's ranks' ``reading`` (None: it has no
        running rank) and the other nodes'; 0: none is asked."""

    @abc.abstractmethod
    def publish_progress(
        self, attempt: int, rows: List[ProgressRow], copies: Optional[CopyReading] = None
    ) -> Optional[JobRows]:
        """The live ranks' steps (and this node's copies on other nodes), for ``ftlaunch status``;
        where the run is held, every rank of the job as published (else None)."""

    def keep_alive(self) -> None:  # noqa: B027 - a hook; by default nothing
        """Called often while workers start and run: the run's lease, where this node holds it."""

    def group_running(self) -> None:  # noqa: B027 - a hook; by default nothing
        """The attempt's workers all started."""


class _HolderLink(PeerLink):
    """The only node's and node 0's: they hold the run, its lease and its restart policy."""

    def __init__(self, run: Run, may_restart: Callable[[AttemptResult], bool]) -> None:
        self.run = run
        self._may_restart = may_restart

    def may_restart(self, local: AttemptResult) -> bool:
        return self._may_restart(local)

    def keep_alive(self) -> None:
        self.run.keep_alive(time.time())

    def group_running(self) -> None:
        self.run.save()  # off the recovery's critical path


class SingleLink(_HolderLink):
    """The only node has no one to tell."""

    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        return local_stop_step(reading) if reading is not None else 0

    def publish_progress(
        self, attempt: int, rows: List[ProgressRow], copies: Optional[CopyReading] = None
    ) -> Optional[JobRows]:
        self.run.publish_progress(attempt, rows)
        return JobRows(rows, {None: socket.gethostname()})


class LeaderLink(_HolderLink):
    """Node 0's: the attempt's channel to every node, and an elastic job's look for nodes that
    wait to join (the job grows: a resize)."""

    def __init__(
        self,
        run: Run,
        may_restart: Callable[[AttemptResult], bool],
        channel: LeaderChannel,
        rendezvous: Rendezvous,
        grows: bool,
        kit: NodeKit,
        attempt: int,
    ) -> None:
        super().__init__(run, may_restart)
        self.channel = channel
        self._rendezvous = rendezvous
        self._grows = grows  # an elastic job below its full size
        self._kit, self._attempt = kit, attempt
        self._next_joiners_look = 0.0
        self._standbys_said = 0  # standbys found lost and said so

    def interrupt(self, kind: InterruptKind, detail: str, signum: Optional[int] = None) -> None:
        self.channel.interrupt(Interrupt(0, kind, detail, signum))

    def tick(self) -> Optional[Interrupt]:
        interrupt = self.channel.tick()
        lost = list(self.channel.standbys_lost.items())
        left = len(self.channel.standby) - len(lost)
        for node, why in lost[self._standbys_said :]:  # a standby lost disturbs nothing: said once
            self._kit.events.emit(StandbyLost(self._attempt, node, why, left))
            self._kit.say(f"{why}: lost; the attempt goes on (it ran no rank); {left} standby node(s) left")
        self._standbys_said = len(lost)
        if interrupt is None and self._joiners_wait():
            detail = "a node waits to join (--nnodes MIN:MAX): the job grows"
            interrupt = self.channel.interrupt(Interrupt(0, InterruptKind.RESIZE, detail))
        return interrupt

    def _joiners_wait(self) -> bool:
        """Whether a node waits in the rendezvous to join (looked at once a second)."""
        if not self._grows:
            return False
        now = time.monotonic()
        if now < self._next_joiners_look:
            return False
        self._next_joiners_look = now + _LOOK_FOR_JOINERS_S
        try:
            return self._rendezvous.nodes_waiting() > 0
        except Exception:  # noqa: BLE001 - the next look asks again; the job runs on meanwhile
            return False

    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        return self.channel.agree_stop_step(reading)

    def publish_progress(
        self, attempt: int, rows: List[ProgressRow], copies: Optional[CopyReading] = None
    ) -> Optional[JobRows]:
        ranks, nodes = self.channel.job_progress(rows, copies)
        self.run.publish_progress(attempt, ranks, nodes)
        return JobRows(ranks, {n.node: n.host or "" for n in nodes})


class FollowerLink(PeerLink):
    """A follower's: the attempt's channel to node 0; it holds nothing of the run."""

    def __init__(self, node: int, channel: FollowerChannel) -> None:
        self.node = node
        self.channel = channel

    def interrupt(self, kind: InterruptKind, detail: str, signum: Optional[int] = None) -> None:
        self.channel.interrupt(Interrupt(self.node, kind, detail, signum))

    def tick(self) -> Optional[Interrupt]:
        return self.channel.tick()

    def decided(self) -> bool:
        return self.channel.decided()

    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        return self.channel.agree_stop_step(reading)

    def publish_progress(
        self, attempt: int, rows: List[ProgressRow], copies: Optional[CopyReading] = None
    ) -> Optional[JobRows]:
        self.channel.share_progress(rows, copies)
        return None
