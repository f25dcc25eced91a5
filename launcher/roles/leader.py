"""Node 0 of many: it holds the run and hosts the job's store; each attempt it meets every node in
a rendezvous round, plans the attempt, merges every node's report and tells them its verdict."""

import dataclasses
import time
from typing import Dict, List, Optional, Set, Tuple

from launcher.cluster.channel import ChannelSpec
from launcher.cluster.leader_channel import LeaderChannel
from launcher.cluster.lobby import say_training
from launcher.cluster.rendezvous import Rendezvous, Round, RoundFailed
from launcher.cluster.wire import (
    Interrupt,
    InterruptKind,
    JobVerdict,
    NodeInfo,
    NodeReport,
    RoundPlan,
    copy_servers,
    plan_problem,
)
from launcher.core.beats import BeatSummary, Entered
from launcher.core.events import NodesMet, RoundAbandoned
from launcher.core.failures import NodeLostFailure, root_cause, sure_blame
from launcher.core.layout import Layout
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.policy import RestartPolicy
from launcher.core.results import AttemptResult, RunResult
from launcher.grammar.errors import (
    ExitCode,
    FtlaunchError,
    JoinTimeout,
    NodeUnhealthy,
    SignalReceived,
    UsageError,
)
from launcher.process.kit import NodeKit
from launcher.roles.exclusion import Exclusion
from launcher.roles.holder import RunHolder
from launcher.roles.link import LeaderLink
from launcher.roles.lobby_host import LobbyHost
from launcher.roles.membership import Membership
from launcher.roles.places import Places
from launcher.roles.role import AttemptPlan, Conclusion, in_attempt
from launcher.runs.run import Run

__all__ = ["Leader", "node_report"]


def node_report(node: int, result: AttemptResult) -> NodeReport:
    """What a node tells node 0 about the attempt."""
    beats = result.beats
    return NodeReport(
        node,
        result.outcome.value,
        result.failures,
        beats.beat,
        beats.furthest_step,
        result.signum,
        result.restored,
        {str(rank): [e.seq, e.kind] for rank, e in result.collectives.items()},
    )


def _with_reports(result: AttemptResult, reports: List[NodeReport]) -> AttemptResult:
    """What every node's report adds: whose snapshots came from a copy, every rank's last collective."""
    restored = "; ".join(r.restored for r in reports if r.restored)
    return dataclasses.replace(result, restored=restored, collectives=_entered(reports))


def _entered(reports: List[NodeReport]) -> Dict[int, Entered]:
    """Every reporting node's ranks' last collectives; what does not parse is left out."""
    found = {}
    for report in reports:
        for rank, pair in report.collectives.items():
            seq, kind = pair if isinstance(pair, list) and len(pair) == 2 else (None, None)
            if (
                isinstance(seq, int)
                and not isinstance(seq, bool)
                and isinstance(kind, str)
                and rank.isdigit()
            ):
                found[int(rank)] = Entered(seq, kind, report.node)
    return found


class Leader(RunHolder):
    def __init__(
        self,
        job: Membership,
        run: Run,
        kit: NodeKit,
        policy: RestartPolicy,
        store_at: Tuple[str, int],
        injectable: bool,
        rendezvous: Rendezvous,
    ) -> None:
        super().__init__(run, kit, policy, store_at, injectable)
        self.job = job
        self._rendezvous = rendezvous
        self._round: Optional[Round] = None  # the rendezvous round the next attempt may keep
        self._channel: Optional[LeaderChannel] = None  # the attempt's, from meet to decide
        self._link: Optional[LeaderLink] = None  # the attempt's, from its plan on
        self._spec = ChannelSpec.of(job.cluster)
        self._lobby = LobbyHost(job, rendezvous.store, kit.signals, kit.say)
        self._layout: Optional[Layout] = None  # the attempt's, from meet on
        self._announced: Optional[Layout] = None  # the last layout said on the console
        self._unhealthy = False  # this node failed its health check: the job waits for node 0
        self._places = Places(job.cluster, job.nproc, run, kit)  # who trains where (--standby-nodes)
        self._exclusion = Exclusion(policy, run, kit)
        self._excluding: Dict[int, str] = {}  # decided after the attempt: nodes that must leave, why
        self._gone: Set[int] = set()  # nodes of the kept round found lost: not waited for again

    @property
    def channel(self) -> LeaderChannel:
        return in_attempt(self._channel, "channel")

    @property
    def layout(self) -> Layout:
        return in_attempt(self._layout, "layout")

    @property
    def link(self) -> LeaderLink:
        return in_attempt(self._link, "link")

    # -- between attempts ------------------------------------------------------------------------

    def meet(self) -> AttemptPlan:
        """Every node joins this attempt's round and announces itself; node 0 checks they agree
        and plans the attempt on every node of the round, never on fewer. A round one of whose
        nodes never announces itself fails, and the nodes meet again, within --join-timeout."""
        started = time.monotonic()
        while True:
            new_round = self._round is None
            if self._round is None:
                self._round = self._rendezvous.next_round(self._signals, self._say, watch=self._lobby.watch)
                self._gone = set()
            meeting = self._round
            channel = LeaderChannel(
                meeting.next_attempt_store(),
                self._spec,
                self._signals,
                job_store=self._rendezvous.store,
                gone=self._lobby.gone.gone,
            )
            self._channel = channel
            channel.announce(self.job.info())
            count = meeting.size - len(self._gone)
            try:
                infos = channel.node_infos(count, self.job.announce_timeout, self._lobby.watch_round)
            except RoundFailed as failed:
                self._meet_again(channel, meeting.size, str(failed), started)
                continue
            return self._plan(channel, infos, started, new_round)

    def _meet_again(self, channel: LeaderChannel, size: int, why: str, started: float) -> None:
        """The round failed: every node that announced itself is told to meet in a new one."""
        self._events.emit(RoundAbandoned(size, why))
        channel.publish_plan(RoundPlan(-1, "", 0, round_failed=why))
        channel.close()
        self._channel, self._round = None, None
        if time.monotonic() - started >= self.job.cluster.join_timeout:
            raise JoinTimeout(
                f"the nodes could not meet within --join-timeout ({self.job.cluster.join_timeout:g} s): "
                f"{why}; the same command relaunched on every node resumes the job"
            )
        self._say(f"{why}: the nodes meet again in a new round (a job never starts short of a node)")

    def _plan(
        self, channel: LeaderChannel, infos: Dict[int, NodeInfo], started: float, new_round: bool
    ) -> AttemptPlan:
        """Plan the attempt on the nodes that announced themselves, checked as every node checks it."""
        cluster, nproc = self.job.cluster, self.job.nproc
        placed = self._places.place(infos)
        layout = Layout(placed.nodes, 0, nproc, placed.standby)
        draft = RoundPlan(-1, "", 0, list(layout.nodes), world_size=layout.world_size)
        draft = dataclasses.replace(draft, standby=list(layout.standby), copies=copy_servers(infos))
        problem = self.job.disagreement(infos) or plan_problem(
            draft, 0, nproc, cluster.fewest, cluster.nnodes, cluster.standby
        )
        if problem:
            channel.publish_plan(RoundPlan(0, "", 0, refused=problem))
            channel.await_acks("planned")  # the store goes away with this node
            channel.close()
            raise UsageError(problem)
        self._layout = layout
        number = self._open_attempt(self._places.members(channel.members(), layout), layout.world_size)
        self._announce_size(layout)
        self._lobby.planned += 1
        waited = round(time.monotonic() - started, 3)
        standby = list(layout.standby) if cluster.standby else None
        self._events.emit(NodesMet(number, len(layout.nodes), waited, new_round, list(layout.nodes), standby))
        self._places.planned(number, placed, layout, self.entry)
        address, port = self._store_at[0], self.store.port
        plan = dataclasses.replace(draft, attempt=number, master_addr=address, master_port=port)
        grows = cluster.elastic and len(layout.nodes) < cluster.nnodes
        self._link = LeaderLink(
            self.run, self.may_restart, channel, self._rendezvous, grows, self._kit, number
        )
        channel.set_standby(layout.standby)
        say_training(self._rendezvous.store, number)
        channel.publish_plan(plan)
        return AttemptPlan(number, address, port, layout, plan.copy_servers())

    def _announce_size(self, layout: Layout) -> None:
        """An elastic job says on which nodes each attempt runs, when that changes."""
        cluster = self.job.cluster
        if not cluster.elastic or (self._announced and self._announced.nodes == layout.nodes):
            return
        self._announced = layout
        resize = f" ({self.entry.resize})" if self.entry.resize else ""
        self._say(
            f"the job runs on {layout.describe()} of --nnodes {cluster.fewest}:{cluster.nnodes}{resize}"
        )

    def ended_waiting(self, error: FtlaunchError, attempts: List[AttemptResult]) -> RunResult:
        if isinstance(error, SignalReceived):
            self._lobby.pass_on_stop(error)
        self._unhealthy = isinstance(error, NodeUnhealthy)
        return super().ended_waiting(error, attempts)

    def conclude(self, local: AttemptResult) -> Conclusion:
        """The job's attempt: every node's report (this one's included) and every lost node."""
        self._close_store()
        channel = self.channel
        channel.report(node_report(0, local))
        reports = channel.gather(self.job.report_timeout)
        result = _merge(
            local,
            reports,
            channel.own_stall() + channel.lost_failures(),
            channel.interrupted_by,
            self.layout,
            self.job.cluster.elastic,
        )
        result = dataclasses.replace(result, resize=self.entry.resize, replaced=self.entry.replaced)
        result = self._with_culprit(_with_reports(result, reports))
        self._places.left({f.node: f.describe() for f in channel.lost_failures()})
        told = channel.interrupted_by
        first = told.node if told is not None and told.kind is InterruptKind.FAILURE else None
        if result.outcome is AttemptOutcome.FAILED:
            self.entry.blamed_node = sure_blame(result.failures, first)
        self._record_end(result)
        return Conclusion(result)

    def decide(
        self, concluded: Conclusion, attempts: List[AttemptResult]
    ) -> Tuple[Optional[RunResult], float]:
        refused = self.channel.interrupted_by
        if refused is not None and refused.kind is InterruptKind.REFUSED:  # nodes disagree: no retry
            return RunResult(ExitCode.USAGE, RunStatus.FAILED, attempts, refused.detail), 0.0
        result = concluded.result
        standing_by = [n for n in self.layout.standby if n not in self.channel.standbys_lost]
        lost = {f.node for f in result.failures if isinstance(f, NodeLostFailure)}
        replaced = result.outcome is AttemptOutcome.NODE_LOST and _replaceable(
            lost, self.layout, self.channel
        )
        if self._signals.first is None and result.outcome is AttemptOutcome.NODE_LOST:
            if replaced or self._places.outside(result, self._lobby.outside):
                self._places.replacing(result, standing_by)
                return None, 0.0
        ended, delay = super().decide(concluded, attempts)
        self._excluding = {}
        if result.outcome is AttemptOutcome.FAILED:
            self._excluding, ended = self._exclusion.after_failure(ended, standing_by, self.entry.nodes)
            self._places.left(self._excluding)
        return ended, delay

    def announce(self, concluded: Conclusion, ended: Optional[RunResult], delay: float) -> None:
        result = concluded.result
        if ended is not None and self.job.cluster.standby:  # nodes may wait outside the round
            inside = {*self.layout.nodes, *self.layout.standby}
            self._lobby.tell_outside(int(ended.exit_code), ended.reason, inside)
        if ended is not None:
            verdict = JobVerdict.end(
                ended.exit_code,
                ended.status,
                ended.reason,
                result.outcome,
                result.failures,
                cause=result.cause,
            )
        else:
            same_round = delay == 0 and self._same_nodes_again()
            verdict = JobVerdict.restart(
                result.outcome,
                result.failures,
                same_round=same_round,
                cause=result.cause,
                excluded=list(self._excluding),
                excluded_why="; ".join(self._excluding.values()),
            )
        self._tell_nodes(verdict)

    def not_started(self, error: Exception) -> None:
        super().not_started(error)
        if self._channel is not None:
            failed = AttemptOutcome.FAILED
            self._tell_nodes(JobVerdict.end(ExitCode.FAILED, RunStatus.FAILED, str(error), failed, []))

    def close(self) -> None:
        """The job is over: a node that comes now learns it at once instead of waiting. Unless
        node 0 is unhealthy: the others wait for it as for a lost node 0 (relaunched on a
        healthy machine, it resumes the job)."""
        if not self._unhealthy:
            self._rendezvous.close()
        self._lobby.gone.close()

    def _tell_nodes(self, verdict: JobVerdict) -> None:
        """Node 0's decision goes to every node; the store stays up until each has read it. A
        restart at once keeps the round when it can; after a backoff pause, the nodes meet in a
        new one (in the pause nothing beats on the next attempt's keys)."""
        channel, self._channel = self.channel, None
        if not verdict.same_round:
            self._round = None
        say_training(self._rendezvous.store, None)
        channel.publish_verdict(verdict)
        if not verdict.restarts:
            channel.await_acks()
        channel.close()

    def _same_nodes_again(self) -> bool:
        """The next attempt may keep this round when none waits to join and no node was lost, or
        (--standby-nodes) each lost training node has a standby of the round to take its place:
        a new round would wait for torch to give up on the lost node (its keep-alive) first."""
        channel = self.channel
        lost = {f.node for f in channel.lost_failures()} | set(self._excluding)
        if channel.left_by_all or (lost and not _replaceable(lost, self.layout, channel)):  # meet anew
            return False
        try:
            waiting = self._rendezvous.nodes_waiting()
        except Exception:  # noqa: BLE001 - in doubt, a new round finds out who is there
            return False
        if waiting == 0:
            self._gone |= lost | set(channel.standbys_lost)
        return waiting == 0


def _replaceable(lost: Set[int], layout: Layout, channel: LeaderChannel) -> bool:
    """Each lost node trained (and is not node 0, which cannot be replaced), and a standby of the
    round still there can take each one's place."""
    standing_by = [n for n in layout.standby if n not in channel.standbys_lost]
    return 0 not in lost and lost <= set(layout.nodes) and len(standing_by) >= len(lost)


def _merge(
    local: AttemptResult,
    reports: List[NodeReport],
    lost: List[NodeLostFailure],
    interrupt: Optional[Interrupt],
    layout: Layout,
    elastic: bool,
) -> AttemptResult:
    """The job's attempt from every node's report. A lost node (a supervisor that died or froze,
    this one included) is not a failure of the workers: in an elastic job it is a change of the
    job's nodes, in a fixed one NODE_LOST; the failures it caused elsewhere (every peer's
    collective breaks at once) are kept on record but not counted. A follower that reported and
    then went silent (a signal while it waited for the verdict ends it) had ended its part of the
    attempt: its silence is no loss of this attempt."""
    reported = {r.node for r in reports}
    lost = [f for f in lost if f.stalled or f.node not in reported]
    failures = _cause_first([f for r in reports for f in r.failures] + lost)
    if lost:  # a supervisor died or froze: its node's ranks and their peers' collectives with it
        outcome, signum = (AttemptOutcome.RESIZED if elastic else AttemptOutcome.NODE_LOST), None
    elif interrupt is not None and interrupt.kind is InterruptKind.RESIZE and not failures:
        outcome, signum = AttemptOutcome.RESIZED, None
    elif failures or any(r.outcome == AttemptOutcome.FAILED.value for r in reports):
        outcome, signum = AttemptOutcome.FAILED, None
    elif interrupt is not None and interrupt.kind is InterruptKind.STOP:
        outcome, signum = AttemptOutcome.stopped_by(interrupt.signum), interrupt.signum
        local = dataclasses.replace(local, signal_name=interrupt.detail)  # as the node it reached names it
    elif len(reports) == len(layout.nodes):
        outcome, signum = AttemptOutcome.SUCCEEDED, None
    else:
        outcome, signum = AttemptOutcome.FAILED, None
    steps = [r.furthest_step for r in reports if r.furthest_step is not None]
    beats = BeatSummary(any(r.beat for r in reports), max(steps) if steps else None)
    cause = f"node {interrupt.node}: {interrupt.detail}" if interrupt is not None else local.cause
    if lost:
        cause = "; ".join(f.describe() for f in sorted(lost, key=lambda f: f.blame_order))
    return dataclasses.replace(
        local, outcome=outcome, failures=failures, signum=signum, beats=beats, cause=cause
    )


def _cause_first(failures: list) -> list:
    """Every node's failures, the root cause first (run.json's first failure is the one to read)."""
    if not failures:
        return failures
    first = root_cause(failures)
    return [first] + [f for f in failures if f is not first]
