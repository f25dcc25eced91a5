"""The supervisor: monitor → decide → act, one attempt at a time. On one node it runs the node's
group; with many nodes this is node 0's side (it holds the run, meets the others each attempt,
merges their reports and decides for the job); the others run ``cluster.follower``."""

import dataclasses
import os
import signal
import sys
import time
from typing import BinaryIO, Callable, Dict, List, Optional, Tuple

from launcher.attempt import AttemptResult, AttemptRunner
from launcher.cluster.channel import AttemptChannel, AttemptPlan, InterruptKind, JobVerdict, NodeInfo
from launcher.cluster.rendezvous import Rendezvous, Round, host_job_store
from launcher.config import LaunchConfig
from launcher.errors import ExitCode, Interrupted, JoinTimeout, StartFailed, UsageError, exit_code_for_signal
from launcher.events import Decision, EventLog, NodesMet, RunEnd, RunStart
from launcher.hangs.board import BeatSummary
from launcher.hangs.monitor import HangMonitor
from launcher.outcomes import AttemptOutcome, RunStatus
from launcher.policy import RestartPolicy, Verdict
from launcher.process.forkserver import ForkServer, ForkServerSpawner
from launcher.process.linux import become_subreaper
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.signals import SignalInbox
from launcher.process.store import AttemptStore
from launcher.process.workers import PopenSpawner, Spawner
from launcher.recovery import Recovery, goodput, recoveries
from launcher.runs.directory import RunDir
from launcher.runs.run import Run

__all__ = ["AttemptResult", "RunResult", "Supervisor", "supervise"]


def _to_stderr(line: str) -> None:
    print(f"[ftlaunch] {line}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    status: RunStatus
    attempts: List[AttemptResult]
    reason: str
    recoveries: List[Recovery] = dataclasses.field(default_factory=list)
    goodput: Optional[float] = None  # over the whole run, earlier supervisors included
    holds_run: bool = True  # False on a follower node: recoveries and goodput are node 0's to tell


def supervise(
    config: LaunchConfig,
    signals: SignalInbox,
    say: Callable[[str], None] = _to_stderr,
    spawner: Optional[Spawner] = None,
    console_out: Optional[BinaryIO] = None,
    console_err: Optional[BinaryIO] = None,
) -> RunResult:
    """Hold the run, set up what a run needs, run it to its end, and tear it all down.
    The caller owns this process (the supervisor reaps its children) and has opened ``signals``."""
    console = (console_out or sys.stdout.buffer, console_err or sys.stderr.buffer)
    own_spawner = spawner is None
    spawner = spawner or _spawner_for(config, say)
    try:
        if config.many_nodes and not config.leads:
            from launcher.cluster.follower import follow

            return follow(config, signals, say, spawner, console)
        return _lead(config, signals, say, spawner, console)
    finally:
        if own_spawner and isinstance(spawner, ForkServerSpawner):
            spawner.close()


def _spawner_for(config: LaunchConfig, say: Callable[[str], None]) -> Spawner:
    """Plain spawning, or forks of a warm fork server that falls back to it."""
    plain = PopenSpawner(ignored=(config.preempt_signal,))
    if not config.fork_server:
        return plain
    server = ForkServer(config, config.log_dir / "forkserver.log", ignored=(config.preempt_signal,))
    return ForkServerSpawner(server, plain, say)


def _lead(config: LaunchConfig, signals: SignalInbox, say, spawner: Spawner, console) -> RunResult:
    """Node 0, or the only node: hold the run and supervise it."""
    job_store = host_job_store(config) if config.many_nodes else None  # the others may already wait
    directory = RunDir(config.run_url)
    taken_from = directory.acquire(config.lease)  # before anything is written, logs included
    try:
        become_subreaper()
        with EventLog(config.log_dir / "events.jsonl") as events:
            events.emit(RunStart(run_id=config.run_id, config=config.to_json(), pid=os.getpid()))
            with OrphanGuard() as guard:
                run = Run(config, directory, events, say, taken_from)
                rendezvous = Rendezvous(config, job_store) if job_store is not None else None
                supervisor = Supervisor(
                    config, run, events, signals, guard, say, spawner, console, rendezvous
                )
                return supervisor.run()
    finally:
        directory.release()


class Supervisor:
    """Runs a held run's attempts until one succeeds, a signal stops it, or the policy gives up.
    With ``rendezvous`` (many nodes, this is node 0) each attempt spans every node."""

    def __init__(
        self,
        config: LaunchConfig,
        run: Run,
        events: EventLog,
        signals: SignalInbox,
        guard: OrphanGuard,
        say: Callable[[str], None],
        spawner: Spawner,
        console: Tuple[BinaryIO, BinaryIO],
        rendezvous: Optional[Rendezvous] = None,
    ) -> None:
        self.config = config
        self._run = run
        self._events = events
        self._signals = signals
        self._say = say
        self._rendezvous = rendezvous
        self._round: Optional[Round] = None  # the rendezvous round the next attempt may keep
        self._policy = RestartPolicy(
            config.max_failures,
            config.failure_window,
            config.crash_loop,
            config.backoff,
            config.backoff_cap,
            count_injected=config.chaos_counts,
        )
        beat_before = any(a.beat for a in run.state.attempts)  # e.g. before a kill -9 of ftlaunch
        hangs = HangMonitor(config, events, say, run.mark_first_step, beat_before)
        self._runner = AttemptRunner(config, events, signals, guard, say, spawner, console, hangs, run)

    def run(self) -> RunResult:
        try:
            if self._run.already_succeeded:
                return self._already_succeeded()
            limit = self.config.max_preemptions
            if 0 <= limit < self._run.preemptions:
                reason = f"preempted {self._run.preemptions} time(s), --max-preemptions {limit}"
                result = RunResult(ExitCode.FAILED, RunStatus.FAILED, [], reason)
            else:
                result = self._run_attempts()
        finally:
            if self._rendezvous is not None:
                self._rendezvous.close()  # a node that comes late learns at once that the job is over
        self._remove_uncommitted_parts()
        result = dataclasses.replace(
            result,
            recoveries=recoveries(self._events.logged),
            goodput=goodput(self._run.state.attempts, time.time()),
        )
        self._run.finish(result.status, result.reason, int(result.exit_code))
        self._events.emit(RunEnd(exit_code=int(result.exit_code), reason=result.reason))
        return result

    # -- the loop ---------------------------------------------------------------------------

    def _run_attempts(self) -> RunResult:
        attempts: List[AttemptResult] = []
        newest = self._run.newest_checkpoint()
        self._runner.warm_up()
        while True:
            number = self._run.state.next_attempt
            try:
                channel = self._meet(number)
            except (Interrupted, JoinTimeout) as err:
                return self._ended_waiting(err, attempts)
            entry = self._run.attempt_started(number, newest.step, channel.members() if channel else None)
            try:
                result = self._run_attempt(number, channel)
            except StartFailed as err:
                self._run.attempt_not_started(entry)
                self._tell_nodes(channel, False, ExitCode.FAILED, RunStatus.FAILED, str(err), None)
                if not attempts:  # nothing of this launch ran, nothing was written: bad input
                    raise UsageError(str(err)) from None
                raise
            attempts.append(result)
            newest = self._run.newest_checkpoint()  # what this attempt left is where the next one starts
            self._run.attempt_ended(
                entry, result.outcome, result.failures, newest, result.beats, result.lived
            )
            ended, delay = self._decide(number, result, entry.progress_evidence, attempts)
            if ended is not None:
                self._tell_nodes(channel, False, ended.exit_code, ended.status, ended.reason, result)
                return ended
            self._tell_nodes(channel, True, 0, RunStatus.RUNNING, "restart", result, at_once=delay == 0)
            self._pause(delay)

    def _decide(
        self, number: int, result: AttemptResult, evidence: str, attempts: List[AttemptResult]
    ) -> Tuple[Optional[RunResult], float]:
        """How the run ends after this attempt, or (None, delay): restart after ``delay`` seconds."""
        ended = RunStatus.ended_by(result.outcome)
        if result.outcome is AttemptOutcome.SUCCEEDED:
            return RunResult(ExitCode.SUCCESS, ended, attempts, "every rank exited 0"), 0.0
        if result.outcome.stopped_by_signal:
            name = signal.Signals(result.signum).name
            code = exit_code_for_signal(result.signum)
            return RunResult(code, ended, attempts, f"interrupted by {name}"), 0.0
        decision = self._policy.after_failure(self._run.state.history(), time.time())
        self._events.emit(Decision(number, decision.verdict.value, decision.reason, decision.delay))
        self._say(f"attempt {number} failed: {result.describe_cause()}")
        if decision.verdict is Verdict.CRASH_LOOP:
            reason = f"{decision.reason} (the last: {evidence})"
            return RunResult(ExitCode.CRASH_LOOP, ended, attempts, reason), 0.0
        if not decision.restart:
            return RunResult(ExitCode.FAILED, ended, attempts, decision.reason), 0.0
        wait = f"; waiting {decision.delay:g} s first (backoff)" if decision.delay else ""
        self._say(f"restarting the group ({decision.reason}){wait}")
        return None, decision.delay

    def _pause(self, seconds: float) -> None:
        """Wait between attempts, keeping the run's lease; a signal ends the wait."""
        deadline = time.monotonic() + seconds
        while self._signals.first is None and time.monotonic() < deadline:
            self._signals.wait(min(1.0, deadline - time.monotonic()))
            self._run.keep_alive(time.time())

    def _already_succeeded(self) -> RunResult:
        state = self._run.state
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.updated_at))
        reason = f"run {state.url} had already succeeded ({ended}); --fresh starts it again"
        return RunResult(ExitCode.SUCCESS, RunStatus.SUCCEEDED, [], reason)

    def _ended_waiting(self, err: Exception, attempts: List[AttemptResult]) -> RunResult:
        """A signal, or --join-timeout, while the nodes were meeting: the run can be resumed."""
        if isinstance(err, Interrupted):
            signum = self._signals.first
            status = RunStatus.ended_by(AttemptOutcome.stopped_by(signum))
            reason = f"interrupted by {signal.Signals(signum).name} while the nodes were meeting"
            return RunResult(exit_code_for_signal(signum), status, attempts, reason)
        return RunResult(ExitCode.JOIN_TIMEOUT, RunStatus.STOPPED, attempts, str(err))

    def _run_attempt(self, attempt: int, channel: Optional[AttemptChannel]) -> AttemptResult:
        store = self._open_store()
        try:
            if channel is not None:
                channel.publish_plan(AttemptPlan(attempt, self.config.master_addr, store.port))
            local = self._runner.run(attempt, self.config.master_addr, store.port, channel)
        finally:
            store.close()
        return local if channel is None else self._merge(local, channel)

    # -- many nodes ---------------------------------------------------------------------------

    def _meet(self, attempt: int) -> Optional[AttemptChannel]:
        """Every node joins this attempt's rendezvous round; node 0 checks they agree."""
        if self._rendezvous is None:
            return None
        started, new_round = time.monotonic(), self._round is None
        if new_round:
            self._round = self._rendezvous.next_round(self._signals, self._say)
        channel = AttemptChannel(self._round.next_attempt_store(), self.config)
        channel.announce()
        problem = _disagreement(self.config, channel.node_infos(self._signals.wait))
        if problem:
            channel.publish_plan(AttemptPlan(attempt, "", 0, refused=problem))
            channel.await_acks(self._signals.wait, "planned")  # the store goes away with this node
            channel.close()
            raise UsageError(problem)
        waited = round(time.monotonic() - started, 3)
        self._events.emit(NodesMet(attempt, self.config.nnodes, waited, new_round))
        return channel

    def _merge(self, local: AttemptResult, channel: AttemptChannel) -> AttemptResult:
        """The job's attempt: every node's report (this one's included) and every lost node."""
        channel.report(local.report(self.config.node_rank))
        reports = channel.gather(self._signals.wait)
        failures = [f for r in reports for f in r.failures] + channel.lost_failures()
        interrupt = channel.interrupted_by
        if failures or any(r.outcome == AttemptOutcome.FAILED.value for r in reports):
            outcome, signum = AttemptOutcome.FAILED, None
        elif interrupt is not None and interrupt.kind is InterruptKind.STOP:
            outcome, signum = AttemptOutcome.stopped_by(interrupt.signum), interrupt.signum
        elif len(reports) == self.config.nnodes:
            outcome, signum = AttemptOutcome.SUCCEEDED, None
        else:
            outcome, signum = AttemptOutcome.FAILED, None
        steps = [r.furthest_step for r in reports if r.furthest_step is not None]
        beats = BeatSummary(any(r.beat for r in reports), max(steps) if steps else None)
        cause = f"node {interrupt.node}: {interrupt.detail}" if interrupt is not None else local.cause
        return dataclasses.replace(
            local, outcome=outcome, failures=failures, signum=signum, beats=beats, cause=cause
        )

    def _tell_nodes(
        self,
        channel: Optional[AttemptChannel],
        restart: bool,
        exit_code: int,
        status: RunStatus,
        reason: str,
        result: Optional[AttemptResult],
        at_once: bool = False,
    ) -> None:
        """Node 0's decision goes to every node; the store stays up until each has read it. A
        restart ``at_once`` keeps the round when it can; after a backoff pause, the nodes meet in
        a new one (in the pause nothing beats on the next attempt's keys)."""
        if channel is None:
            return
        outcome = result.outcome.value if result is not None else AttemptOutcome.FAILED.value
        failures = result.failures if result is not None else []
        same_round = restart and at_once and self._same_nodes_again(channel)
        if not same_round:
            self._round = None
        verdict = JobVerdict(restart, int(exit_code), status.value, reason, outcome, failures, same_round)
        channel.publish_verdict(verdict)
        if not restart:
            channel.await_acks(self._signals.wait)
        channel.close()

    def _same_nodes_again(self, channel: AttemptChannel) -> bool:
        """The next attempt may keep this round when no node was lost and none waits to join."""
        if channel.lost_failures():
            return False
        try:
            return self._rendezvous.nodes_waiting() == 0
        except Exception:  # noqa: BLE001 - in doubt, a new round finds out who is there
            return False

    # -- helpers ---------------------------------------------------------------------------

    def _remove_uncommitted_parts(self) -> None:
        """The run is over and no worker runs: parts that never got their commit marker go."""
        removed = self._run.checkpoints.remove_uncommitted()
        if removed:
            steps = ", ".join(map(str, removed))
            self._say(f"removed the parts of step(s) {steps}, which were never committed")

    def _open_store(self) -> AttemptStore:
        try:
            return AttemptStore(self.config.master_addr, self.config.master_port)
        except OSError as err:
            where = f"{self.config.master_addr}:{self.config.master_port}"
            message = f"cannot listen on {where} for the workers' store: {err.strerror or err}"
            raise StartFailed(message) from None


def _disagreement(config: LaunchConfig, infos: Dict[int, NodeInfo]) -> str:
    """Nodes started with other commands or other --nproc cannot form one job."""
    for node, info in sorted(infos.items()):
        if info.nproc != config.nproc:
            return f"node {node} ({info.host}) runs --nproc {info.nproc}, node 0 runs --nproc {config.nproc}"
        if tuple(info.command) != config.command:
            return f"node {node} ({info.host}) runs another command than node 0: {' '.join(info.command[1:])}"
    return ""
