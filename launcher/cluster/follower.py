"""A node other than node 0: it holds nothing of the run. Each attempt it joins the round, learns
the attempt number and the workers' store from node 0, runs its ranks, reports how they ended and
does what node 0 decides. When node 0 is lost it stops its ranks and waits for node 0 to come back
(the same command relaunched there resumes the job), up to --join-timeout."""

import dataclasses
import os
import time
from typing import BinaryIO, Callable, List, Tuple

from launcher.attempt import AttemptResult, AttemptRunner
from launcher.cluster.channel import AttemptChannel, JobVerdict
from launcher.cluster.rendezvous import LeaderUnreachable, Rendezvous, Round, connect_job_store
from launcher.config import LaunchConfig
from launcher.errors import Interrupted, UsageError
from launcher.events import EventLog, NodesMet, RunEnd, RunStart
from launcher.hangs.monitor import HangMonitor
from launcher.outcomes import AttemptOutcome, RunStatus
from launcher.process.linux import become_subreaper
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.signals import SignalInbox
from launcher.process.workers import Spawner

__all__ = ["follow"]


def follow(
    config: LaunchConfig,
    signals: SignalInbox,
    say: Callable[[str], None],
    spawner: Spawner,
    console: Tuple[BinaryIO, BinaryIO],
):
    become_subreaper()
    with EventLog(config.log_dir / "events.jsonl") as events:
        events.emit(RunStart(run_id=config.run_id, config=config.to_json(), pid=os.getpid()))
        with OrphanGuard() as guard:
            # Whether the script beats is node 0's knowledge (run.json); here it is learned afresh.
            hangs = HangMonitor(config, events, say, lambda: None, False)
            runner = AttemptRunner(config, events, signals, guard, say, spawner, console, hangs, None)
            result = Follower(config, runner, events, signals, say).run()
            events.emit(RunEnd(exit_code=int(result.exit_code), reason=result.reason))
            return result


class Follower:
    def __init__(
        self,
        config: LaunchConfig,
        runner: AttemptRunner,
        events: EventLog,
        signals: SignalInbox,
        say: Callable[[str], None],
    ) -> None:
        self.config = config
        self._runner = runner
        self._events = events
        self._signals = signals
        self._say = say

    def run(self):
        from launcher.supervisor import RunResult

        attempts: List[AttemptResult] = []
        rendezvous, kept = None, None
        deadline = time.monotonic() + self.config.join_timeout
        self._runner.warm_up()
        while True:
            try:
                if rendezvous is None:
                    store = connect_job_store(self.config, deadline, self._signals, self._say)
                    rendezvous = Rendezvous(self.config, store)
                started = time.monotonic()
                round_ = kept or rendezvous.next_round(self._signals, self._say)
                result, verdict = self._attempt(round_, started, kept is None)
            except LeaderUnreachable as lost:
                self._say(
                    f"lost node 0 ({lost}); this node's workers are stopped; waiting for node 0 to come "
                    f"back (the same command relaunched there resumes the job), up to --join-timeout "
                    f"{self.config.join_timeout:g} s"
                )
                rendezvous.shutdown()
                rendezvous, kept, deadline = None, None, time.monotonic() + self.config.join_timeout
                continue
            except Interrupted as stopped:
                status = RunStatus.ended_by(AttemptOutcome.stopped_by(self._signals.first))
                return RunResult(stopped.exit_code, status, attempts, str(stopped), holds_run=False)
            attempts.append(result)
            if not verdict.restart:
                return RunResult(
                    verdict.exit_code, RunStatus(verdict.status), attempts, verdict.reason, holds_run=False
                )
            kept = round_ if verdict.same_round else None
            deadline = time.monotonic() + self.config.join_timeout

    def _attempt(self, round_: Round, started: float, new_round: bool) -> Tuple[AttemptResult, JobVerdict]:
        """One attempt: join it, run this node's ranks, report, and take node 0's verdict."""
        channel = AttemptChannel(round_.next_attempt_store(), self.config)
        try:
            channel.announce()
            plan = channel.read_plan(self._signals.wait)
            if plan.refused:
                raise UsageError(plan.refused)
            waited = round(time.monotonic() - started, 3)
            self._events.emit(NodesMet(plan.attempt, self.config.nnodes, waited, new_round))
            local = self._runner.run(plan.attempt, plan.master_addr, plan.master_port, channel)
            channel.report(local.report(self.config.node_rank))
            verdict = channel.await_verdict(self._signals.wait)
        finally:
            channel.close()
        job = dataclasses.replace(
            local,
            outcome=AttemptOutcome(verdict.outcome),
            failures=verdict.failures,
            signum=local.signum,
        )
        return job, verdict
