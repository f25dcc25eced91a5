"""A node other than node 0: it holds nothing of the run. Each attempt it joins the round, learns
the attempt number and the workers' store from node 0, runs its ranks, reports how they ended and
does what node 0 decides. When node 0 is lost it stops its ranks and waits for node 0 to come back
(the same command relaunched there resumes the job), up to --join-timeout."""

import dataclasses
import time
from typing import List, Optional, Tuple

from launcher.cluster.channel import ChannelSpec
from launcher.cluster.follower_channel import FollowerChannel
from launcher.cluster.rendezvous import LeaderUnreachable, Round, RoundFailed
from launcher.cluster.wire import (
    Interrupt,
    InterruptKind,
    JobVerdict,
    NodeReport,
    RoundPlan,
    plan_problem,
)
from launcher.core import failpoints
from launcher.core.config import RunSection
from launcher.core.events import NodesMet
from launcher.core.layout import Layout
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.results import AttemptResult, RunResult, ended_by_signal, meeting_stopped
from launcher.grammar.errors import (
    ExitCode,
    FtlaunchError,
    JobOver,
    JoinTimeout,
    NodeUnhealthy,
    SignalReceived,
    StandbyReleased,
    UsageError,
)
from launcher.process.kit import NodeKit
from launcher.roles.leader import node_report
from launcher.roles.link import FollowerLink
from launcher.roles.membership import Membership
from launcher.roles.node0 import Node0Connection
from launcher.roles.role import AttemptPlan, Conclusion, NodeRole, in_attempt

__all__ = ["Follower"]

# --standby-nodes: while a node joins, how often it asks whether it waits outside a running round.
_OUTSIDE_LOOK_S = 2.0


class Follower(NodeRole):
    """``run``: the run's section, for node 0's record of the job's end (shared storage)."""

    def __init__(self, job: Membership, run: RunSection, kit: NodeKit) -> None:
        self.job = job
        self.run = run
        self.node = job.node
        self._events, self._signals, self._say = kit.events, kit.signals, kit.say
        self._spec = ChannelSpec.of(job.cluster)
        self._node0 = Node0Connection(job, run, kit.signals, kit.say)
        self._kept: Optional[Round] = None  # node 0 said the next attempt keeps this round
        self._deadline: Optional[float] = None  # to reach node 0: set when the wait begins
        self._round: Optional[Round] = None  # the round of the attempt in progress
        self._channel: Optional[FollowerChannel] = None
        self._link: Optional[FollowerLink] = None
        self._place: Optional[int] = -1  # --standby-nodes: GROUP_RANK said last (None: standing by)
        self._outside_said = False  # this node said it waits outside a round the job trains in
        self._next_outside_look = 0.0

    @property
    def channel(self) -> FollowerChannel:
        return in_attempt(self._channel, "channel")

    @property
    def link(self) -> FollowerLink:
        return in_attempt(self._link, "link")

    # -- between attempts ------------------------------------------------------------------------

    def meet(self) -> AttemptPlan:
        """Join the round and read node 0's plan; a lost node 0 is waited for, up to
        --join-timeout (JoinTimeout)."""
        while True:
            started, new_round = time.monotonic(), self._kept is None
            try:
                return self._join(started, new_round)
            except LeaderUnreachable as lost:
                self._lost_leader(lost, " while the nodes were meeting")
            except RoundFailed as failed:
                self._say(f"node 0: {failed}; meeting again in a new round")
                self._kept = None
            except JoinTimeout as timeout:
                if not self.job.cluster.standby:
                    raise
                self._stand_by_outside(timeout)
            except JobOver as over:
                if not self._outside_said:
                    raise
                raise StandbyReleased(
                    f"the job ended while node {self.node} stood by outside its round ({over}); "
                    "nothing ran here"
                ) from None

    def _check(self, plan: RoundPlan) -> None:
        """Before any rank starts: node 0's plan is a whole job this node can run its part of.
        One it cannot (another version of ftlaunch on node 0, say) stops the attempt on every
        node with the reason (UsageError here, the same reason in node 0's verdict)."""
        cluster = self.job.cluster
        problem = plan_problem(
            plan, self.node, self.job.nproc, cluster.fewest, cluster.nnodes, cluster.standby
        )
        if not problem:
            return
        problem = f"node {self.node} refused node 0's plan: {problem}"
        try:
            self.channel.interrupt(Interrupt(self.node, InterruptKind.REFUSED, problem))
            self.channel.report(NodeReport(self.node, AttemptOutcome.FAILED.value, [], False, None))
        except LeaderUnreachable:
            pass  # node 0 finds this node gone instead
        finally:
            self.channel.close()
        raise UsageError(problem)

    def _join(self, started: float, new_round: bool) -> AttemptPlan:
        if not self._node0.connected:
            if self._deadline is None:  # the first meeting: the time to warm up is not waiting
                self._deadline = time.monotonic() + self.job.cluster.join_timeout
            self._node0.connect(self._deadline)
        if self._kept is None:
            failpoints.reached("before-round")
        watch = self._watch_outside if self.job.cluster.standby else self._node0.watch
        say = self._say_unless_outside  # outside a running round, "waiting for N nodes" is not so
        round_ = self._kept or self._node0.rendezvous.next_round(self._signals, say, watch=watch)
        self._node0.met(outside_said=self._outside_said)
        self._kept, self._outside_said = None, False
        failpoints.reached("round-joined")
        self._channel = FollowerChannel(
            round_.next_attempt_store(), self._spec, self._signals, beater=self._node0.beater
        )
        self._round = round_
        try:
            self.channel.announce(self.job.info())
            failpoints.reached("announced")
            plan = self.channel.read_plan(self.job.report_timeout, self._node0.watch)
        except BaseException:
            self.channel.close()
            raise
        if plan.refused:
            self.channel.close()
            raise UsageError(plan.refused)
        if plan.round_failed:
            self.channel.close()
            raise RoundFailed(plan.round_failed)
        if self.job.cluster.standby and self.node not in [*plan.nodes, *plan.standby]:
            self.channel.close(quietly=True)  # its attempt goes on without this node
            raise RoundFailed(
                f"it planned attempt {plan.attempt} without node {self.node}, found lost before (a "
                "standby took its place); this node stands by from the next round"
            )
        self._check(plan)
        nodes = tuple(plan.nodes)
        waited = round(time.monotonic() - started, 3)
        standby = list(plan.standby) if self.job.cluster.standby else None
        self._events.emit(NodesMet(plan.attempt, len(nodes), waited, new_round, list(nodes), standby))
        layout = Layout(nodes, self.node, self.job.nproc, tuple(plan.standby))
        self._say_place(layout)
        self._link = FollowerLink(self.node, self.channel)
        return AttemptPlan(plan.attempt, plan.master_addr, plan.master_port, layout, plan.copy_servers())

    def _say_place(self, layout: Layout) -> None:
        """--standby-nodes: this node's part, said when it changes (it stands by, or trains where)."""
        place = layout.group_rank if layout.trains else None
        if not self.job.cluster.standby or place == self._place:
            return
        self._place = place
        if place is None:
            self._say(f"node {self.node} stands by, warm, running no rank; the job: {layout.describe()}")
        else:
            self._say(f"node {self.node} trains at GROUP_RANK {place} ({layout.describe()})")

    def _watch_outside(self) -> None:
        """While it joins (--standby-nodes): node 0's word, and whether this node waits for the
        next round while the job trains without it (the round it came to was complete)."""
        self._node0.watch()
        now = time.monotonic()
        if self._outside_said or now < self._next_outside_look:
            return
        self._next_outside_look = now + _OUTSIDE_LOOK_S
        if self._node0.training():  # nodes that are in the attempt's round do not join
            self._say_outside()

    def _say_unless_outside(self, line: str) -> None:
        if not self._outside_said:
            self._say(line)

    def _say_outside(self) -> None:
        if not self._outside_said:
            self._outside_said = True
            self._node0.waits_outside(True)  # node 0 counts on it to take a lost node's place
            self._say(
                f"node {self.node} came while the job trains without it: it waits to stand by from "
                "the next round (it disturbs no running attempt)"
            )

    def _stand_by_outside(self, timeout: JoinTimeout) -> None:
        """--standby-nodes: a node that came while the job trains waits outside its round (a late
        standby, a lost node relaunched) until the next one, however long the attempt runs. Its
        join timing out is no reason to leave while node 0 trains: it joins again. JoinTimeout
        when node 0 does not answer, or trains nothing (the job never got its nodes)."""
        if not self._node0.connected:  # node 0 never answered
            raise timeout
        try:
            self._node0.watch()
            if not self._node0.training():
                raise timeout
        except LeaderUnreachable:
            raise timeout from None
        self._say_outside()

    def conclude(self, local: AttemptResult) -> Conclusion:
        """Report to node 0 and take its verdict: the job's outcome of the attempt. Node 0 lost
        meanwhile: the attempt is lost with it (as node 0's next supervisor records it), and this
        node meets again."""
        try:
            self.channel.report(node_report(self.node, local))
            verdict = self.channel.await_verdict(2 * self.job.report_timeout)
        except LeaderUnreachable as lost:
            self._lost_leader(lost, "; this node's workers are stopped")
            lost_with = dataclasses.replace(local, outcome=AttemptOutcome.SUPERVISOR_LOST, cause=str(lost))
            again = JobVerdict.restart(lost_with.outcome, local.failures, same_round=False, cause=str(lost))
            return Conclusion(lost_with, again)
        except SignalReceived as stopped:  # a signal while node 0 decides: this node leaves
            self._stop_every_node(stopped)
            return Conclusion(local, _leaving(stopped, local))
        finally:
            self.channel.close()
        self._kept = self._round if verdict.restarts and verdict.same_round else None
        self._deadline = time.monotonic() + self.job.cluster.join_timeout
        job = dataclasses.replace(
            local,
            outcome=AttemptOutcome(verdict.outcome),
            failures=verdict.failures,
            cause=verdict.cause or local.cause,
        )
        return Conclusion(job, verdict)

    def decide(
        self, concluded: Conclusion, attempts: List[AttemptResult]
    ) -> Tuple[Optional[RunResult], float]:
        """Node 0's verdict, as this node's decision."""
        verdict = concluded.verdict
        if verdict is not None and self.node in verdict.excluded:  # --exclude-after: it leaves
            reason = f"this node is {verdict.excluded_why}"
            return RunResult(ExitCode.UNHEALTHY, RunStatus.STOPPED, attempts, reason, holds_run=False), 0.0
        if verdict is None or verdict.restarts:
            return None, 0.0
        ended = RunResult(
            verdict.exit_code, RunStatus(verdict.status), attempts, verdict.reason, holds_run=False
        )
        return ended, 0.0

    def not_started(self, error: Exception) -> None:
        if self._channel is not None:
            self.channel.close()

    def ended_waiting(self, error: FtlaunchError, attempts: List[AttemptResult]) -> RunResult:
        if isinstance(error, SignalReceived):
            self._node0.pass_on_stop(error)
            while_ = meeting_stopped(error)
            return ended_by_signal(error.signum, attempts, while_, holds_run=False, said_as=error.said_as)
        if isinstance(error, NodeUnhealthy):  # it leaves, as a lost node: the others go on without it
            self._node0.leave_unhealthy(str(error))
        return RunResult(error.exit_code, RunStatus.STOPPED, attempts, str(error), holds_run=False)

    def _stop_every_node(self, stopped: SignalReceived) -> None:
        """This node's ranks are done, others may still run: the signal stops them as one during
        the attempt would (a stop, not this node leaving, which node 0 would count as a failure)."""
        try:
            self.channel.interrupt(Interrupt(self.node, InterruptKind.STOP, stopped.said_as, stopped.signum))
        except LeaderUnreachable:
            pass

    def pause(self, seconds: float) -> None:
        """Node 0 pauses (its backoff) before it meets the nodes again: the next round waits."""

    def close(self) -> None:
        self._node0.close()

    def _lost_leader(self, lost: LeaderUnreachable, then: str) -> None:
        """Wait for node 0 anew: a fresh connection and a new round. ``then``: what this node was
        doing (no workers run while the nodes meet)."""
        self._say(
            f"lost node 0 ({lost}){then}; waiting for node 0 to come "
            f"back (the same command relaunched there resumes the job), up to --join-timeout "
            f"{self.job.cluster.join_timeout:g} s"
        )
        self._node0.drop()
        self._kept = None
        self._deadline = time.monotonic() + self.job.cluster.join_timeout


def _leaving(stopped: SignalReceived, local: AttemptResult) -> JobVerdict:
    """The verdict this node gives itself when a signal ends its wait for node 0's."""
    while_ = "while waiting for node 0's verdict"
    ended = ended_by_signal(stopped.signum, [], while_, holds_run=False, said_as=stopped.said_as)
    return JobVerdict.end(ended.exit_code, ended.status, ended.reason, local.outcome, local.failures)
