"""The run's loop and the roles' decisions with scripted parts: a fake role for ``run_attempts``,
a fake run for ``RunHolder.decide``, a fake channel for the follower, and node 0's merge of the
nodes' reports as the pure function it is (issue 35, item 3)."""

import signal
from typing import List, Optional, Tuple

import pytest

from launcher.agent.loop import run_attempts
from launcher.agent.parts import membership
from launcher.cluster.rendezvous import LeaderUnreachable
from launcher.cluster.wire import Interrupt, InterruptKind, JobVerdict, NodeReport
from launcher.core.config import LaunchConfig
from launcher.core.failures import NodeLostFailure, ProcessFailure
from launcher.core.layout import Layout
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.policy import AttemptRecord, RestartPolicy
from launcher.core.results import AttemptResult, RunResult
from launcher.grammar.errors import ExitCode, FtlaunchError, JoinTimeout, SignalReceived
from launcher.process.kit import NodeKit
from launcher.process.signals import SignalInbox
from launcher.roles.follower import Follower
from launcher.roles.holder import RunHolder
from launcher.roles.leader import _merge
from launcher.roles.link import PeerLink
from launcher.roles.role import AttemptPlan, Conclusion, NodeRole

CRASH = ProcessFailure(rank=1, local_rank=1, pid=11, exitcode=1, observed_at=5.0)


class ScriptedLink(PeerLink):
    def agree_stop_step(self, reading) -> int:
        return 0

    def publish_progress(self, attempt, rows) -> None:
        pass


class ScriptedRole(NodeRole):
    """Plays back each attempt's outcome and its decision; records every call in order."""

    def __init__(self, decisions: List[Tuple[bool, float]], meet_error: Optional[Exception] = None):
        self.decisions, self.meet_error, self.calls = list(decisions), meet_error, []
        self.attempt = 0

    def meet(self) -> AttemptPlan:
        if self.meet_error is not None and self.attempt == len(self.decisions) - 1:
            raise self.meet_error
        self.calls.append(f"meet {self.attempt}")
        return AttemptPlan(self.attempt, "127.0.0.1", 1, Layout((0,), 0, 1))

    def conclude(self, local: AttemptResult) -> Conclusion:
        self.calls.append(f"conclude {local.attempt}")
        return Conclusion(local)

    def decide(self, concluded: Conclusion, attempts: List[AttemptResult]):
        ends, delay = self.decisions[concluded.result.attempt]
        self.calls.append(f"decide {concluded.result.attempt}")
        self.attempt += 1
        if ends:
            return RunResult(ExitCode.SUCCESS, RunStatus.SUCCEEDED, attempts, "done"), 0.0
        return None, delay

    def announce(self, concluded: Conclusion, ended: Optional[RunResult], delay: float) -> None:
        self.calls.append(f"announce {'end' if ended else 'restart'}")

    def not_started(self, error: Exception) -> None:
        self.calls.append("not started")

    def ended_waiting(self, error: FtlaunchError, attempts: List[AttemptResult]) -> RunResult:
        self.calls.append(f"ended waiting: {type(error).__name__}")
        return RunResult(ExitCode.FAILED, RunStatus.FAILED, attempts, str(error))

    def pause(self, seconds: float) -> None:
        self.calls.append(f"pause {seconds:g}")

    @property
    def link(self) -> PeerLink:
        return ScriptedLink()


class ScriptedRunner:
    def __init__(self, role: ScriptedRole, outcomes: List[AttemptOutcome]):
        self.role, self.outcomes = role, outcomes

    def warm_up(self) -> None:
        self.role.calls.append("warm up")

    def run(self, plan: AttemptPlan, link: PeerLink) -> AttemptResult:
        self.role.calls.append(f"run {plan.attempt}")
        return AttemptResult(plan.attempt, self.outcomes[plan.attempt])

    def concluded(self, result: AttemptResult, restarting: bool) -> None:
        self.role.calls.append(f"concluded {result.attempt} {'restarting' if restarting else 'ending'}")


def test_the_loop_meets_runs_concludes_decides_announces_and_pauses_in_that_order():
    role = ScriptedRole([(False, 2.0), (True, 0.0)])
    runner = ScriptedRunner(role, [AttemptOutcome.FAILED, AttemptOutcome.SUCCEEDED])
    ended = run_attempts(role, runner)
    assert ended.status is RunStatus.SUCCEEDED
    assert [a.outcome for a in ended.attempts] == [AttemptOutcome.FAILED, AttemptOutcome.SUCCEEDED]
    assert role.calls == [
        "warm up",
        "meet 0", "run 0", "conclude 0", "decide 0", "announce restart", "concluded 0 restarting", "pause 2",
        "meet 1", "run 1", "conclude 1", "decide 1", "announce end", "concluded 1 ending",
    ]  # fmt: skip


@pytest.mark.parametrize("error", [SignalReceived(signal.SIGTERM), JoinTimeout("no node 0 within 10 s")])
def test_a_signal_or_the_join_timeout_while_meeting_ends_the_run_through_the_role(error):
    role = ScriptedRole([(False, 0.0), (True, 0.0)], meet_error=error)
    ended = run_attempts(role, ScriptedRunner(role, [AttemptOutcome.FAILED]))
    assert role.calls[-1] == f"ended waiting: {type(error).__name__}"
    assert [a.attempt for a in ended.attempts] == [0]


class FakeRun:
    """What RunHolder.decide reads of the run: its attempts' history, for the policy."""

    def __init__(self, history: List[AttemptRecord]):
        self.state = self
        self._history = history

    def history(self) -> List[AttemptRecord]:
        return self._history


class Emitted(list):
    def emit(self, event) -> None:
        self.append(event)


def _holder(history: List[AttemptRecord], max_failures: int = 3) -> Tuple[RunHolder, Emitted, list]:
    events, said = Emitted(), []
    policy = RestartPolicy(max_failures=max_failures, crash_loop=0)

    class Holder(RunHolder):  # the decision is RunHolder's; the rest of a role is not asked
        meet = ended_waiting = pause = link = conclude = None

    Holder.__abstractmethods__ = frozenset()
    holder = Holder(FakeRun(history), NodeKit(events, SignalInbox(), said.append), policy, ("127.0.0.1", 0))
    return holder, events, said


def test_node_0_restarts_a_failed_attempt_within_the_budget_and_ends_the_run_past_it():
    failed = AttemptResult(0, AttemptOutcome.FAILED, [CRASH])
    holder, events, _ = _holder([AttemptRecord(0, AttemptOutcome.FAILED, 0.0)], max_failures=1)
    assert holder.decide(Conclusion(failed), [failed]) == (None, 0.0)
    assert [e.verdict for e in events] == ["RESTART"]
    history = [AttemptRecord(n, AttemptOutcome.FAILED, 0.0) for n in range(2)]
    holder, events, _ = _holder(history, max_failures=1)
    ended, _ = holder.decide(Conclusion(failed), [failed, failed])
    assert ended.exit_code == ExitCode.FAILED and ended.status is RunStatus.FAILED
    assert "failure budget spent" in ended.reason


def test_a_lost_node_and_a_resize_spend_no_failure_and_a_success_ends_the_run():
    holder, events, said = _holder([AttemptRecord(0, AttemptOutcome.FAILED, 0.0)] * 5, max_failures=0)
    lost = AttemptResult(3, AttemptOutcome.NODE_LOST, cause="node 1 lost")
    assert holder.decide(Conclusion(lost), [lost]) == (None, 0.0)
    resized = AttemptResult(4, AttemptOutcome.RESIZED, cause="node 2 joined")
    assert holder.decide(Conclusion(resized), [resized]) == (None, 0.0)
    assert [e.verdict for e in events] == ["node_lost", "resize"]
    done = AttemptResult(5, AttemptOutcome.SUCCEEDED)
    ended, _ = holder.decide(Conclusion(done), [done])
    assert ended.exit_code == ExitCode.SUCCESS and ended.status is RunStatus.SUCCEEDED


def test_a_signal_received_while_the_attempt_ended_ends_the_run_with_its_exit_code():
    holder, _, _ = _holder([])
    stopped = AttemptResult(0, AttemptOutcome.PREEMPTED, signum=signal.SIGTERM)
    ended, _ = holder.decide(Conclusion(stopped), [stopped])
    assert ended.exit_code == 128 + signal.SIGTERM and ended.reason == "interrupted by SIGTERM"


LAYOUT = Layout((0, 1), 0, 1)


def _report(node: int, outcome=AttemptOutcome.SUCCEEDED, failures=()) -> NodeReport:
    return NodeReport(node, outcome.value, list(failures), beat=True, furthest_step=10 * (node + 1))


def test_node_0_merges_every_nodes_report_into_the_jobs_outcome():
    local = AttemptResult(0, AttemptOutcome.SUCCEEDED)
    both = _merge(local, [_report(0), _report(1)], [], None, LAYOUT, elastic=False)
    assert both.outcome is AttemptOutcome.SUCCEEDED and both.beats.furthest_step == 20
    one = _merge(local, [_report(0)], [], None, LAYOUT, elastic=False)
    assert one.outcome is AttemptOutcome.FAILED  # a node that never reported: not a success
    crashed = _merge(local, [_report(0), _report(1, AttemptOutcome.FAILED, [CRASH])], [], None, LAYOUT, False)
    assert crashed.outcome is AttemptOutcome.FAILED and crashed.failures == [CRASH]
    stop = Interrupt(1, InterruptKind.STOP, "SIGTERM", signal.SIGTERM)
    stopped = _merge(local, [_report(0), _report(1)], [], stop, LAYOUT, elastic=False)
    assert stopped.outcome is AttemptOutcome.stopped_by(signal.SIGTERM) and stopped.cause == "node 1: SIGTERM"


@pytest.mark.parametrize(
    "elastic, outcome", [(False, AttemptOutcome.NODE_LOST), (True, AttemptOutcome.RESIZED)]
)
def test_a_lost_node_is_no_failure_of_the_workers(elastic, outcome):
    lost = NodeLostFailure(node=1, host="b", pid=7, silent_for=4.0, observed_at=9.0)
    broken = ProcessFailure(rank=0, local_rank=0, pid=3, exitcode=1, observed_at=9.5)  # its peer's collective
    local = AttemptResult(0, AttemptOutcome.FAILED, [broken])
    merged = _merge(local, [_report(0, AttemptOutcome.FAILED, [broken])], [lost], None, LAYOUT, elastic)
    assert merged.outcome is outcome and merged.failures[0] is lost  # the cause first, the peer kept
    assert merged.cause == lost.describe()


class FakeChannel:
    def __init__(self, verdict=None, error: Optional[Exception] = None):
        self.verdict, self.error, self.reported, self.closed = verdict, error, [], False
        self.interrupts: list = []

    def interrupt(self, interrupt) -> None:
        self.interrupts.append(interrupt)

    def report(self, report: NodeReport) -> None:
        self.reported.append(report)

    def await_verdict(self, limit: float) -> JobVerdict:
        if self.error is not None:
            raise self.error
        return self.verdict

    def close(self) -> None:
        self.closed = True


def _follower(channel: FakeChannel) -> Tuple[Follower, list]:
    config = LaunchConfig.of(entrypoint="x.py", nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:1")
    said: list = []
    follower = Follower(membership(config), config.run, NodeKit(Emitted(), SignalInbox(), said.append))
    follower._channel = channel
    return follower, said


def test_a_follower_concludes_with_node_0s_verdict_and_decides_by_it():
    verdict = JobVerdict.end(1, RunStatus.FAILED, "failure budget spent", AttemptOutcome.FAILED, [CRASH])
    channel = FakeChannel(verdict)
    follower, _ = _follower(channel)
    local = AttemptResult(2, AttemptOutcome.FAILED, cause="node 0 said so")
    concluded = follower.conclude(local)
    assert channel.reported[0].node == 1 and channel.closed
    assert concluded.verdict == verdict and concluded.result.failures == [CRASH]
    ended, delay = follower.decide(concluded, [concluded.result])
    assert (ended.exit_code, ended.status, ended.reason, ended.holds_run) == (
        1, RunStatus.FAILED, "failure budget spent", False
    )  # fmt: skip
    restart = JobVerdict.restart(AttemptOutcome.FAILED, [CRASH], same_round=True)
    follower, _ = _follower(FakeChannel(restart))
    assert follower.decide(follower.conclude(local), []) == (None, 0.0)


def test_a_follower_that_loses_node_0_while_it_decides_meets_again():
    follower, said = _follower(FakeChannel(error=LeaderUnreachable("node 0's store: connection refused")))
    concluded = follower.conclude(AttemptResult(2, AttemptOutcome.FAILED))
    assert concluded.result.outcome is AttemptOutcome.SUPERVISOR_LOST
    assert follower.decide(concluded, [concluded.result]) == (None, 0.0)
    assert "lost node 0 (node 0's store: connection refused); this node's workers are stopped;" in said[0]


def test_a_follower_signalled_while_node_0_decides_leaves_with_the_signals_exit_code():
    channel = FakeChannel(error=SignalReceived(signal.SIGINT))
    follower, _ = _follower(channel)
    concluded = follower.conclude(AttemptResult(2, AttemptOutcome.FAILED))
    ended, _ = follower.decide(concluded, [concluded.result])
    assert ended.exit_code == 128 + signal.SIGINT
    assert ended.reason == "interrupted by SIGINT while waiting for node 0's verdict"
    # The other nodes are stopped as by a signal during the attempt, not told this one left.
    (stop,) = channel.interrupts
    assert (stop.node, stop.kind.value, stop.signum) == (1, "stop", signal.SIGINT)


def test_a_follower_silent_after_its_report_is_no_lost_node_of_the_attempt():
    """Node 1 reported, sent a stop (SIGTERM while it waited for the verdict) and exited; node 0,
    slow to stop its own ranks, found it silent for --node-timeout before it gathered the reports.
    The attempt was stopped by the signal, as every node reported; node 0's own stall still counts."""
    local = AttemptResult(0, AttemptOutcome.PREEMPTED)
    gone = NodeLostFailure(node=1, host="b", pid=7, silent_for=3.0, observed_at=9.0)
    stop = Interrupt(1, InterruptKind.STOP, "SIGTERM", signal.SIGTERM)
    merged = _merge(local, [_report(0), _report(1)], [gone], stop, LAYOUT, elastic=False)
    assert merged.outcome is AttemptOutcome.stopped_by(signal.SIGTERM) and merged.failures == []
    stalled = NodeLostFailure(node=0, host="a", pid=3, silent_for=4.0, observed_at=9.0, stalled=True)
    merged = _merge(local, [_report(0)], [stalled], None, LAYOUT, elastic=False)
    assert merged.outcome is AttemptOutcome.NODE_LOST
