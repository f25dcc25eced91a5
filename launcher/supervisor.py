"""The supervisor: monitor → decide → act, one attempt's worker group at a time."""

import dataclasses
import logging
import os
import signal
import sys
import time
from typing import BinaryIO, Callable, List, Optional, Tuple

from launcher.config import LaunchConfig
from launcher.errors import ExitCode, StartFailed, UsageError, exit_code_for_signal
from launcher.events import (
    Decision,
    EventLog,
    GuardRestarted,
    RunEnd,
    RunStart,
    StopRequested,
    Transition,
    WorkerExit,
)
from launcher.failures import Failure, HangFailure, ProcessFailure, read_error_file, root_cause
from launcher.group_state import ALLOWED_TRANSITIONS, GroupState, GroupStateMachine
from launcher.hangs.board import BeatSummary, HeartbeatBoard
from launcher.hangs.monitor import HangMonitor, progress_rows
from launcher.hangs.stacks import main_thread_stack
from launcher.outcomes import AttemptOutcome, RunStatus
from launcher.policy import RestartPolicy, Verdict
from launcher.process.linux import become_subreaper
from launcher.process.logs import LogPump, tail_lines
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import plan_workers
from launcher.process.signals import SignalInbox
from launcher.process.store import AttemptStore
from launcher.process.workers import Exit, PopenSpawner, Spawner, WorkerGroup
from launcher.recovery import Recovery, goodput, recoveries
from launcher.runs.directory import RunDir
from launcher.runs.run import Run

__all__ = ["AttemptResult", "RunResult", "Supervisor", "supervise"]

log = logging.getLogger(__name__)

# The loop sleeps in select() on the signal pipe; SIGCHLD wakes it the moment a worker dies.
# The timeout only bounds how long a missed wakeup could go unnoticed.
_MONITOR_TIMEOUT_S = 0.05
_LOG_TAIL_LINES = 20
_PROGRESS_EVERY_S = 5.0  # how often the live ranks' steps go to the run dir for `ftlaunch status`


def _to_stderr(line: str) -> None:
    print(f"[ftlaunch] {line}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class AttemptResult:
    attempt: int
    outcome: AttemptOutcome  # never SUPERVISOR_LOST: that is found by the next supervisor
    failures: List[Failure] = dataclasses.field(default_factory=list)
    signum: Optional[int] = None  # when stopped by a signal
    lived: float = 0.0  # seconds from its start until the supervisor saw it end
    beats: BeatSummary = BeatSummary(beat=False, furthest_step=None)

    @property
    def root_cause(self) -> Optional[Failure]:
        return root_cause(self.failures) if self.failures else None


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    status: RunStatus
    attempts: List[AttemptResult]
    reason: str
    recoveries: List[Recovery] = dataclasses.field(default_factory=list)
    goodput: Optional[float] = None  # over the whole run, earlier supervisors included


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
    directory = RunDir(config.run_url)
    taken_from = directory.acquire(config.lease)  # before anything is written, logs included
    try:
        become_subreaper()
        with EventLog(config.log_dir / "events.jsonl") as events:
            events.emit(RunStart(run_id=config.run_id, config=config.to_json(), pid=os.getpid()))
            with OrphanGuard() as guard:
                run = Run(config, directory, events, say, taken_from)
                console = (console_out or sys.stdout.buffer, console_err or sys.stderr.buffer)
                supervisor = Supervisor(config, run, events, signals, guard, say, spawner, console)
                return supervisor.run()
    finally:
        directory.release()


class Supervisor:
    """Runs a held run's attempts until one succeeds, a signal stops it, or the policy gives up."""

    def __init__(
        self,
        config: LaunchConfig,
        run: Run,
        events: EventLog,
        signals: SignalInbox,
        guard: OrphanGuard,
        say: Callable[[str], None],
        spawner: Optional[Spawner],
        console: Tuple[BinaryIO, BinaryIO],
    ) -> None:
        self.config = config
        self._run = run
        self._events = events
        self._signals = signals
        self._guard = guard
        self._say = say
        self._spawner = spawner or PopenSpawner()
        self._console = console
        self._policy = RestartPolicy(
            config.max_failures, config.failure_window, config.crash_loop, config.backoff, config.backoff_cap
        )
        beat_before = any(a.beat for a in run.state.attempts)  # e.g. before a kill -9 of ftlaunch
        self._hangs = HangMonitor(config, events, say, run.mark_first_step, beat_before)
        self._next_progress = 0.0

    def run(self) -> RunResult:
        if self._run.already_succeeded:
            return self._already_succeeded()
        limit = self.config.max_preemptions
        if 0 <= limit < self._run.preemptions:
            reason = f"preempted {self._run.preemptions} time(s), --max-preemptions {limit}"
            result = RunResult(ExitCode.FAILED, RunStatus.FAILED, [], reason)
        else:
            result = self._run_attempts()
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
        while True:
            number = self._run.state.next_attempt
            entry = self._run.attempt_started(number, newest.step)
            try:
                result = self._run_attempt(number)
            except StartFailed as err:
                self._run.attempt_not_started(entry)
                if not attempts:  # nothing of this launch ran, nothing was written: bad input
                    raise UsageError(str(err)) from None
                raise
            attempts.append(result)
            newest = self._run.newest_checkpoint()  # what this attempt left is where the next one starts
            self._run.attempt_ended(
                entry, result.outcome, result.failures, newest, result.beats, result.lived
            )
            ended = RunStatus.ended_by(result.outcome)
            if result.outcome is AttemptOutcome.SUCCEEDED:
                return RunResult(ExitCode.SUCCESS, ended, attempts, "every rank exited 0")
            if result.outcome.stopped_by_signal:
                name = signal.Signals(result.signum).name
                code = exit_code_for_signal(result.signum)
                return RunResult(code, ended, attempts, f"interrupted by {name}")
            decision = self._policy.after_failure(self._run.state.history(), time.time())
            self._events.emit(Decision(number, decision.verdict.value, decision.reason, decision.delay))
            self._say(f"attempt {number} failed: {result.root_cause.describe()}")
            if decision.verdict is Verdict.CRASH_LOOP:
                reason = f"{decision.reason} (the last: {entry.progress_evidence})"
                return RunResult(ExitCode.CRASH_LOOP, ended, attempts, reason)
            if not decision.restart:
                return RunResult(ExitCode.FAILED, ended, attempts, decision.reason)
            wait = f"; waiting {decision.delay:g} s first (backoff)" if decision.delay else ""
            self._say(f"restarting the group ({decision.reason}){wait}")
            self._pause(decision.delay)

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

    def _run_attempt(self, attempt: int) -> AttemptResult:
        machine = GroupStateMachine(attempt, self._on_transition)
        store = self._open_store()
        board = HeartbeatBoard(self.config.nproc, attempt)
        pump = LogPump(*self._console)
        specs = plan_workers(self.config, attempt, store.port, heartbeat_file=board.path)
        group = WorkerGroup(specs, self._spawner, pump, self._guard, self.config.shows_on_console)
        started = time.monotonic()
        try:
            result = self._start_and_watch(machine, group, board)
            lived = time.monotonic() - started
            self._stop(machine, group, result)
            result = dataclasses.replace(result, lived=lived, beats=BeatSummary.of(board.read().values()))
        except BaseException:
            self._kill_after_error(machine, group)
            raise
        finally:
            pump.close()
            store.close()
            board.close()
        return self._with_log_tails(result)

    def _start_and_watch(
        self, machine: GroupStateMachine, group: WorkerGroup, board: HeartbeatBoard
    ) -> AttemptResult:
        if self._signals.first is not None:  # interrupted between two attempts
            return self._stopped_by_signal(machine.attempt)
        self._say(
            f"attempt {machine.attempt}: starting {self.config.nproc} worker(s), "
            f"backend {self.config.backend}, logs in {group.specs[0].log_file.parent}"
        )
        try:
            group.spawn(go_on=self._spawning_may_go_on)
        except OSError as err:
            machine.transition(GroupState.FAILED, error=str(err))
            raise StartFailed(f"cannot start the workers: {err}") from None
        machine.transition(GroupState.RUNNING, pids=group.pids)
        return self._monitor(machine, group, board)

    def _monitor(
        self,
        machine: GroupStateMachine,
        group: WorkerGroup,
        board: HeartbeatBoard,
    ) -> AttemptResult:
        failures: List[Failure] = []
        watch = self._hangs.watch_attempt()
        while True:
            if self._signals.first is not None:
                self._ask_to_stop(machine.attempt, group, board)
                return self._stopped_by_signal(machine.attempt)
            for exited in group.poll():
                self._record_exit(machine.attempt, exited, failures)
            if failures:
                cause = root_cause(failures)
                machine.transition(
                    GroupState.FAILED, root_cause=cause.describe(), failed_at=cause.observed_at
                )
                return AttemptResult(machine.attempt, AttemptOutcome.FAILED, failures)
            if group.all_exited():
                machine.transition(GroupState.SUCCEEDED)
                return AttemptResult(machine.attempt, AttemptOutcome.SUCCEEDED)
            self._run.keep_alive(time.time())
            self._keep_guard()
            slots = board.read()
            self._publish_progress(machine.attempt, group, slots)
            hung = self._hangs.check(watch, machine.attempt, group, slots)
            if hung:
                cause = root_cause(hung)
                machine.transition(GroupState.HUNG, ranks=[f.rank for f in hung], failed_at=cause.observed_at)
                return AttemptResult(machine.attempt, AttemptOutcome.FAILED, hung)
            self._signals.wait(_MONITOR_TIMEOUT_S)

    def _ask_to_stop(self, attempt: int, group: WorkerGroup, board: HeartbeatBoard) -> None:
        """When every rank calls ft.should_stop(step), give them the grace period to reach a step
        chosen for all (two past the furthest: none can have checked it yet), save it and leave,
        before any signal reaches them. A second signal ends the wait."""
        running = group.running()
        slots = board.read()
        if not running or not all(slots[rank].stop_aware for rank in running):
            return  # a rank that would not stop would leave the others blocked in a collective
        at_step = max(slots[rank].step for rank in running) + 2
        board.request_stop(at_step)
        grace = self.config.grace_period
        self._events.emit(StopRequested(attempt, at_step))
        self._say(
            f"asking the workers to save and stop at step {at_step} (up to {grace:g} s; Ctrl+C again: now)"
        )
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self._stop_cut_short():
            for exited in group.poll():
                self._record_exit(attempt, exited, [])  # an event; exits here are not failures
            if group.all_exited():
                return
            self._signals.wait(_MONITOR_TIMEOUT_S)

    def _publish_progress(self, attempt: int, group: WorkerGroup, slots) -> None:
        now = time.monotonic()
        if now >= self._next_progress:
            self._next_progress = now + _PROGRESS_EVERY_S
            self._run.publish_progress(attempt, progress_rows(slots, group.running(), now))

    def _record_exit(self, attempt: int, exited: Exit, failures: List[Failure]) -> None:
        self._events.emit(
            WorkerExit(attempt, exited.spec.rank, exited.pid, exited.exitcode, exited.observed_at)
        )
        if exited.exitcode != 0:
            failures.append(
                ProcessFailure(
                    rank=exited.spec.rank,
                    local_rank=exited.spec.local_rank,
                    pid=exited.pid,
                    exitcode=exited.exitcode,
                    observed_at=exited.observed_at,
                    error=read_error_file(exited.spec.error_file),
                    log_file=exited.spec.log_file,
                )
            )

    def _stop(self, machine: GroupStateMachine, group: WorkerGroup, result: AttemptResult) -> None:
        """Stop the whole group. After a success this only sweeps up leftover grandchildren."""
        succeeded = result.outcome is AttemptOutcome.SUCCEEDED
        if not succeeded:
            machine.transition(GroupState.STOPPING)
        first_signal = result.signum if result.outcome.stopped_by_signal else signal.SIGTERM
        report = group.stop(first_signal, self.config.grace_period, abort=self._stop_cut_short)
        if report.survivors:
            self._say(f"could not stop pids {report.survivors} (uninterruptible?); left behind")
        if not succeeded:
            machine.transition(
                GroupState.STOPPED,
                killed=report.killed,
                seconds=round(report.seconds, 3),
                survivors=report.survivors,
            )

    def _kill_after_error(self, machine: GroupStateMachine, group: WorkerGroup) -> None:
        """Whatever went wrong in the supervisor itself, no worker outlives this attempt."""
        if GroupState.STOPPING in ALLOWED_TRANSITIONS[machine.state]:
            machine.transition(GroupState.STOPPING)
        group.stop(signal.SIGKILL, 0.0, abort=lambda: True)
        if machine.state is GroupState.STOPPING:
            machine.transition(GroupState.STOPPED, killed=True)

    def _remove_uncommitted_parts(self) -> None:
        """The run is over and no worker runs: parts that never got their commit marker go."""
        removed = self._run.checkpoints.remove_uncommitted()
        if removed:
            steps = ", ".join(map(str, removed))
            self._say(f"removed the parts of step(s) {steps}, which were never committed")

    def _spawning_may_go_on(self) -> bool:
        """Asked between two spawns: the lease stays fresh however many ranks start, and a signal
        stops the rest from starting (the monitor then stops those already running)."""
        self._run.keep_alive(time.time())
        return self._signals.first is None

    def _keep_guard(self) -> None:
        dead = self._guard.restart_if_dead()
        if dead is not None:
            self._events.emit(GuardRestarted(dead_pid=dead, new_pid=self._guard.pid))
            self._say(
                f"the orphan guard (pid {dead}) died; a new one (pid {self._guard.pid}) watches the workers"
            )

    def _stopped_by_signal(self, attempt: int) -> AttemptResult:
        signum = self._signals.first
        return AttemptResult(attempt, AttemptOutcome.stopped_by(signum), signum=signum)

    def _stop_cut_short(self) -> bool:
        """A second Ctrl+C (or any second signal) skips the rest of the grace period."""
        return len(self._signals.received) >= 2

    def _with_log_tails(self, result: AttemptResult) -> AttemptResult:
        """Attach each failed rank's last log lines (and a hung rank's stack), now that the log
        pump has drained."""
        failures = []
        for f in result.failures:
            f = dataclasses.replace(
                f, log_tail=tuple(tail_lines(f.log_file, _LOG_TAIL_LINES) if f.log_file else ())
            )
            if isinstance(f, HangFailure) and f.log_file:
                f = dataclasses.replace(f, stack=main_thread_stack(f.log_file, f.thread_id))
            failures.append(f)
        return dataclasses.replace(result, failures=failures)

    # -- helpers ---------------------------------------------------------------------------

    def _open_store(self) -> AttemptStore:
        try:
            return AttemptStore(self.config.master_addr, self.config.master_port)
        except OSError as err:
            where = f"{self.config.master_addr}:{self.config.master_port}"
            message = f"cannot listen on {where} for the workers' store: {err.strerror or err}"
            raise StartFailed(message) from None

    def _on_transition(self, attempt: int, old: Optional[GroupState], new: GroupState, **details) -> None:
        self._events.emit(Transition(attempt, old, new, **details))
        log.info("attempt %s: %s -> %s", attempt, old and old.value, new.value)
        if new is GroupState.RUNNING:  # off the recovery's critical path: the workers are starting
            self._run.save()
