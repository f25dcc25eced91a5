"""A follower's connection to node 0 between attempts: node 0's store (each call with a deadline),
this node's claim in the lobby, and the job's rendezvous handler. Refusals and stop notices are
read there while the nodes meet; all of it is dropped when node 0 is lost."""

import os
import socket
import time
from typing import Callable, Optional, TypeVar

from launcher.cluster.alive import AliveCounter
from launcher.cluster.deadline_store import DeadlineStore
from launcher.cluster.gone import KEY as GONE_KEY
from launcher.cluster.gone import hold_open
from launcher.cluster.lobby import (
    Hello,
    NodeClaim,
    StopNotice,
    leader_once_started,
    read_ended,
    read_stop,
    say_outside,
    say_stop,
    say_unhealthy,
    stop_read,
    training,
)
from launcher.cluster.rendezvous import LeaderUnreachable, Rendezvous, connect_job_store
from launcher.cluster.store_errors import leader_gone, what_failed
from launcher.cluster.wire import NodeInfo
from launcher.core import failpoints
from launcher.core.config import RunSection
from launcher.core.events import Say
from launcher.core.outcomes import RunStatus
from launcher.grammar.errors import ExitCode, PeerStopped, SignalReceived, StandbyReleased, UsageError
from launcher.process.quiet_torch import import_torch
from launcher.process.signals import SignalInbox
from launcher.roles.membership import Membership
from launcher.roles.role import in_attempt
from launcher.runs.directory import RunDir

__all__ = ["Node0Connection"]

T = TypeVar("T")


class Node0Connection:
    """``run``: the run's section, for node 0's record of the job's end (shared storage)."""

    def __init__(self, job: Membership, run: RunSection, signals: SignalInbox, say: Say) -> None:
        self.job = job
        self.run = run
        self._signals = signals
        self._say = say
        # Torch's store client, loaded now: its import takes seconds on a busy machine, and it must
        # not eat into --join-timeout (CI's spent a whole 8 s one; the timeout is waiting for nodes).
        import_torch()
        hello = Hello(job.node, socket.gethostname(), os.getpid(), job.rdzv_id, list(job.command))
        self._claim = NodeClaim(job.node, hello, job.cluster.node_timeout)
        self._store: Optional[DeadlineStore] = None  # node 0's store, each call with a deadline
        self._rendezvous: Optional[Rendezvous] = None
        self._held: Optional[socket.socket] = None  # node 0 reads its end as this process's (gone.py)
        self._held_at = ""  # the address of node 0's watch it is held to

    @property
    def rendezvous(self) -> Rendezvous:
        return in_attempt(self._rendezvous, "rendezvous")

    @property
    def connected(self) -> bool:
        return self._rendezvous is not None

    @property
    def beater(self) -> Optional[AliveCounter]:
        """The claim's beat, which the attempt's channel keeps up while the ranks run."""
        return self._claim.beater

    def connect(self, deadline: float) -> Rendezvous:
        """Reach node 0's store by ``deadline``, claim this node's rank there and make the job's
        rendezvous handler. Node 0 gone meanwhile: LeaderUnreachable."""
        store = connect_job_store(self.job.cluster, deadline, self._signals, self._say, self._job_ended)
        self._store = DeadlineStore(store, self.job.cluster.node_timeout, self._signals)
        lobby = self._store
        self.call(lambda: self._claim.take(lobby, store, self._signals))
        failpoints.reached("claimed")
        self._fits(self.call(lambda: leader_once_started(lobby)))
        self._hold(lobby)
        # c10d's backend writes to node 0's store as it is made: node 0 may be gone by then.
        self._rendezvous = self.call(lambda: Rendezvous(self.job.cluster, self.job.run_id, store))
        return self._rendezvous

    def _fits(self, leader: Optional[dict]) -> None:
        """A node that comes once the job has started and cannot join it (another command, other
        --nproc or --standby-nodes) leaves alone, exit 2: in a round it would stop the job."""
        if leader is None:
            return
        theirs = NodeInfo(**leader)
        differs = self.job.differs(theirs, f"node 0 ({theirs.host})", f"node {self.job.node}")
        if differs:
            self._claim.release(patient=False)
            raise UsageError(f"{differs}: this node cannot join the running job, which goes on without it")

    def _hold(self, lobby: DeadlineStore) -> None:
        """Hold a connection to node 0's gone-watch, whose address node 0 puts in the lobby once
        it has opened the run: a follower that connected as node 0 started reads it only while
        they meet (found when followers imported torch before their join timeout: they came early
        enough to miss it, and a killed one was found only by its silence)."""
        address = self.call(lambda: lobby.get(GONE_KEY).decode() if lobby.check([GONE_KEY]) else "")
        if address != self._held_at:  # node 0 anew (relaunched): hold on to its watch instead
            self._let_go()
            self._held, self._held_at = hold_open(address, self._claim.token) if address else None, address

    def met(self, outside_said: bool) -> None:
        """A round met: it no longer waits outside one (if it said so), and node 0's gone-watch is
        held before the attempt, had the meeting's looks not found it yet."""
        if outside_said:
            self.waits_outside(False)
        if not self._held_at and self._store is not None:
            self._hold(self._store)

    def watch(self) -> None:
        """While the nodes meet: node 0 may have refused this node (another command), or a node
        got a signal (PeerStopped: this one stops as it does)."""
        if not self._held_at and self._store is not None:
            self._hold(self._store)
        store = self._store
        reason = self.call(lambda: self._claim.refusal(store))
        if reason:
            raise UsageError(reason)
        stop = self.call(lambda: read_stop(store, self.job.node))
        if stop is not None:
            raise PeerStopped(stop.node, stop.signum, stop.said_as)
        ended = self.call(lambda: read_ended(store, self.job.node))
        if ended is not None:  # it waited outside the round of a job that is over
            code, reason = ended
            raise StandbyReleased(
                f"the job ended while node {self.job.node} stood by outside its round (node 0: {reason}); "
                "nothing ran here",
                code if code >= 128 else ExitCode.SUCCESS,  # a preemption is requeued with the others
            )

    def call(self, call: Callable[[], T]) -> T:
        """A call to node 0's store; one that fails as a dead or silent node 0's store fails is
        node 0 lost."""
        try:
            return call()
        except Exception as err:
            if not leader_gone(err):
                raise
            where = self.job.cluster.rdzv_endpoint
            raise LeaderUnreachable(f"node 0's store at {where}: {what_failed(err)}") from None

    def waits_outside(self, outside: bool) -> None:
        """This node waits outside the running round (True), or no longer (False), as node 0 is told."""
        store = self._store
        self.call(lambda: say_outside(store, self.job.node, outside))

    def training(self) -> bool:
        """Whether node 0 runs an attempt now (LeaderUnreachable: node 0 lost)."""
        store = self._store
        return self.call(lambda: training(store))

    def pass_on_stop(self, error: SignalReceived) -> None:
        """A signal here while the nodes meet stops every node: said in node 0's store, where
        every node looks while it meets. Another node's stop: read (node 0 waits for that).
        Best effort: a node 0 that does not answer is lost anyway."""
        store = self._store
        if store is None:  # never reached node 0: no node knows of this one
            return
        try:  # after a signal, node 0 answers each call within a second or is given up
            if isinstance(error, PeerStopped):
                stop_read(store, self.job.node)
            else:
                say_stop(store, StopNotice(self.job.node, error.signum, error.said_as))
        except Exception as err:
            if not leader_gone(err):
                raise

    def leave_unhealthy(self, why: str) -> None:
        """This node failed its health check and leaves: node 0 is told why (best effort: a node 0
        that does not answer learns nothing, and misses this node as it would a lost one)."""
        store = self._store
        if store is None:  # never reached node 0 (the check before the first attempt)
            return
        try:
            say_unhealthy(store, self.job.node, why)
        except Exception as err:
            if not leader_gone(err):
                raise

    def drop(self) -> None:
        """Node 0 is lost: the next meeting starts with a fresh connection. The handler is
        dropped, not shut down: torch's shutdown closes the rendezvous for the whole job."""
        if self._rendezvous is not None:
            self._rendezvous.drop()
        self._rendezvous = None
        self._claim.release(patient=False)  # its beat may be stuck on the lost node 0 too
        # The connection to node 0's watch stays: its end would tell a node 0 that was only
        # stopped, once it runs again, that this node is gone.
        if self._store is not None:
            self._store.close()  # its thread ends once free (it may be stuck in a call)
            self._store = None

    def close(self) -> None:
        """The job's rendezvous is node 0's: only this node's claim goes."""
        self._claim.release(patient=self._store is None or not self._store.stuck)
        self._let_go()

    def _let_go(self) -> None:
        if self._held is not None:
            self._held.close()
        self._held, self._held_at = None, ""

    def _job_ended(self) -> str:
        """Node 0 does not answer: if the run dir (shared storage, as under SLURM) says the run
        succeeded, node 0 will not run it again, and this node came too late (unless --fresh
        starts it again). Unknown: ''."""
        if self.run.fresh:
            return ""
        try:
            state = RunDir(self.run.url).read_state()
        except Exception:  # noqa: BLE001 - not reachable from here, damaged: nothing is known
            return ""
        if state is None or state.status is not RunStatus.SUCCEEDED:
            return ""
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.updated_at))
        return f"the job has ended: run {self.run.url} succeeded at {ended} (node 0's record)"
