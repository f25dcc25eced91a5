"""One attempt on this node: spawn the local ranks, watch them, stop them. The same mechanics on
one node and on each node of many; what the attempt's end means for the run is decided by the
supervisor (node 0) from what every node reports."""

import dataclasses
import logging
import os
import signal
import time
from typing import BinaryIO, Callable, List, Optional, Tuple

from launcher.chaos.injector import ChaosInjector, Injection, mark_injected
from launcher.cluster.channel import AttemptChannel, Interrupt, InterruptKind, NodeReport
from launcher.config import LaunchConfig
from launcher.errors import StartFailed
from launcher.events import (
    ChaosInjected,
    EventLog,
    GuardRestarted,
    PeerInterrupt,
    StopRequested,
    Transition,
    WorkerExit,
)
from launcher.failures import Failure, HangFailure, ProcessFailure, read_error_file, root_cause
from launcher.group_state import ALLOWED_TRANSITIONS, GroupState, GroupStateMachine
from launcher.hangs.board import BeatSummary, HeartbeatBoard
from launcher.hangs.monitor import HangMonitor, progress_rows
from launcher.hangs.stacks import main_thread_stack
from launcher.outcomes import AttemptOutcome
from launcher.process.logs import LogPump, tail_lines
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import plan_workers
from launcher.process.signals import SignalInbox
from launcher.process.workers import Exit, Spawner, WorkerGroup
from launcher.runs.run import Run

__all__ = ["AttemptResult", "AttemptRunner"]

log = logging.getLogger(__name__)

# The loop sleeps in select() on the signal pipe; SIGCHLD wakes it the moment a worker dies.
# The timeout only bounds how long a missed wakeup could go unnoticed (and, with many nodes,
# how often the other nodes' news is looked at).
_MONITOR_TIMEOUT_S = 0.05
_LOG_TAIL_LINES = 20
_PROGRESS_EVERY_S = 5.0  # how often the live ranks' steps go to the run dir for `ftlaunch status`
_SHARE_EVERY_S = 1.0  # how often a follower gives node 0 its ranks' steps (one store write)


@dataclasses.dataclass(frozen=True)
class AttemptResult:
    attempt: int
    outcome: AttemptOutcome  # never SUPERVISOR_LOST: that is found by the next supervisor
    failures: List[Failure] = dataclasses.field(default_factory=list)
    signum: Optional[int] = None  # when stopped by a signal
    lived: float = 0.0  # seconds from its start until the supervisor saw it end
    beats: BeatSummary = BeatSummary(beat=False, furthest_step=None)
    cause: str = ""  # many nodes: why this node's ranks were stopped, when another node said so

    @property
    def root_cause(self) -> Optional[Failure]:
        return root_cause(self.failures) if self.failures else None

    def describe_cause(self) -> str:
        return self.root_cause.describe() if self.failures else self.cause or "unknown"

    def report(self, node: int) -> NodeReport:
        """What this node tells node 0 about the attempt."""
        return NodeReport(
            node, self.outcome.value, self.failures, self.beats.beat, self.beats.furthest_step, self.signum
        )


class _StepRate:
    """How fast the furthest rank steps, in steps per second: over the attempt so far, or over
    the last quarter second when that is faster (a stop request right after the start must
    still know the pace)."""

    _WINDOW_S = 0.25

    def __init__(self) -> None:
        self._first: Optional[Tuple[float, int]] = None
        self._then: Optional[Tuple[float, int]] = None
        self.rate = 0.0

    def observe(self, now: float, furthest: Optional[int]) -> None:
        if furthest is None:
            return
        if self._first is None:
            self._first = self._then = (now, furthest)
            return
        if now - self._then[0] < self._WINDOW_S:
            return
        recent = (furthest - self._then[1]) / (now - self._then[0])
        overall = (furthest - self._first[1]) / (now - self._first[0])
        self.rate = max(0.0, recent, overall)
        self._then = (now, furthest)


class AttemptRunner:
    """Runs one attempt's local worker group from spawn to stop. ``run`` is the held run on the
    node that holds it (node 0, or the only node); other nodes hold nothing."""

    def __init__(
        self,
        config: LaunchConfig,
        events: EventLog,
        signals: SignalInbox,
        guard: OrphanGuard,
        say: Callable[[str], None],
        spawner: Spawner,
        console: Tuple[BinaryIO, BinaryIO],
        hangs: HangMonitor,
        run: Optional[Run],
    ) -> None:
        self.config = config
        self._events = events
        self._signals = signals
        self._guard = guard
        self._say = say
        self._spawner = spawner
        self._console = console
        self._hangs = hangs
        self._run = run
        self._next_progress = 0.0
        self._chaos = ChaosInjector.for_config(config) if config.chaos is not None else None
        self._injected: List[Injection] = []  # this attempt's

    def warm_up(self) -> None:
        """Let the spawner (a fork server importing torch) get going while the supervisor sets up
        the first attempt (its store, the nodes' rendezvous), which imports torch too: the two
        imports overlap. A zygote's environment leaves out what differs per attempt."""
        self._spawner.warm_up(plan_workers(self.config, 0, master_port=0)[0])

    def run(
        self, attempt: int, master_addr: str, master_port: int, channel: Optional[AttemptChannel] = None
    ) -> AttemptResult:
        machine = GroupStateMachine(attempt, self._on_transition)
        board = HeartbeatBoard(self.config.nproc, attempt, first_rank=self.config.global_rank(0))
        pump = LogPump(*self._console)
        specs = plan_workers(
            self.config, attempt, master_port, heartbeat_file=board.path, master_addr=master_addr
        )
        group = WorkerGroup(specs, self._spawner, pump, self._guard, self.config.shows_on_console)
        self._spawner.prepare(specs[0], self._spawning_may_go_on)
        started = time.monotonic()
        self._injected = []
        if self._chaos is not None:
            self._chaos.attempt_started()
        try:
            result = self._start_and_watch(machine, group, board, channel)
            lived = time.monotonic() - started
            self._stop(machine, group, result)
            result = dataclasses.replace(result, lived=lived, beats=BeatSummary.of(board.read().values()))
        except BaseException:
            self._kill_after_error(machine, group)
            raise
        finally:
            pump.close()
            board.close()
        result = self._with_log_tails(result)
        return dataclasses.replace(result, failures=mark_injected(result.failures, self._injected))

    def _start_and_watch(
        self, machine: GroupStateMachine, group: WorkerGroup, board: HeartbeatBoard, channel
    ) -> AttemptResult:
        if self._signals.first is not None:  # interrupted between two attempts
            return self._stopped_by_signal(machine.attempt, self._signals.first)
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
        return self._monitor(machine, group, board, channel)

    def _monitor(
        self, machine: GroupStateMachine, group: WorkerGroup, board: HeartbeatBoard, channel
    ) -> AttemptResult:
        failures: List[Failure] = []
        watch = self._hangs.watch_attempt()
        rate = _StepRate()
        attempt = machine.attempt
        while True:
            if self._signals.first is not None:
                signum = self._signals.first
                if channel is not None:
                    channel.interrupt(Interrupt(self.config.node_rank, InterruptKind.STOP, "signal", signum))
                self._ask_to_stop(attempt, group, board, channel, rate)
                return self._stopped_by_signal(attempt, signum)
            for exited in group.poll():
                self._record_exit(attempt, exited, failures)
            if failures:
                cause = root_cause(failures)
                machine.transition(
                    GroupState.FAILED, root_cause=cause.describe(), failed_at=cause.observed_at
                )
                if channel is not None:
                    channel.interrupt(
                        Interrupt(self.config.node_rank, InterruptKind.FAILURE, cause.describe())
                    )
                return AttemptResult(attempt, AttemptOutcome.FAILED, failures)
            if group.all_exited():
                machine.transition(GroupState.SUCCEEDED)
                return AttemptResult(attempt, AttemptOutcome.SUCCEEDED)
            if self._run is not None:
                self._run.keep_alive(time.time())
            self._keep_guard()
            slots = board.read()
            self._inject_chaos(attempt, group, board, slots)
            rate.observe(time.monotonic(), BeatSummary.of(slots.values()).furthest_step)
            self._publish_progress(attempt, group, slots, channel)
            hung = self._hangs.check(watch, attempt, group, slots)
            if hung:
                cause = root_cause(hung)
                machine.transition(GroupState.HUNG, ranks=[f.rank for f in hung], failed_at=cause.observed_at)
                if channel is not None:
                    channel.interrupt(
                        Interrupt(self.config.node_rank, InterruptKind.FAILURE, cause.describe())
                    )
                return AttemptResult(attempt, AttemptOutcome.FAILED, hung)
            remote = channel.tick() if channel is not None else None
            if remote is not None:
                return self._stopped_by_peer(machine, group, board, channel, rate, remote)
            self._signals.wait(_MONITOR_TIMEOUT_S)

    def _inject_chaos(self, attempt: int, group: WorkerGroup, board: HeartbeatBoard, slots) -> None:
        """--chaos: send the faults that are due, or leave them in the slot for worker_lib (the
        next turns of the loop see what they did)."""
        if self._chaos is None:
            return
        for fault in self._chaos.look(time.monotonic(), group.running(), slots):
            slot = slots.get(fault.rank)
            step = slot.step if slot is not None and slot.beats > 0 and slot.step >= 0 else None
            what = signal.Signals(fault.signum).name if fault.signum else fault.kind
            via = "worker_lib" if fault.request else "signal"
            self._events.emit(ChaosInjected(attempt, fault.fault, what, fault.rank, fault.pid, step, via))
            where = f" at step {step}" if step is not None else ""
            if fault.request:
                board.request_chaos(fault.rank, fault.request)
                self._say(
                    f"chaos: asked rank {fault.rank} (pid {fault.pid}){where} for {what} ({fault.fault})"
                )
                self._injected.append(fault)
                continue
            self._say(f"chaos: {what} to rank {fault.rank} (pid {fault.pid}){where} ({fault.fault})")
            try:
                os.kill(fault.pid, fault.signum)
            except ProcessLookupError:
                continue  # it died on its own first: then its failure is its own
            self._injected.append(fault)

    def _stopped_by_peer(
        self, machine, group: WorkerGroup, board: HeartbeatBoard, channel, rate: _StepRate, remote: Interrupt
    ) -> AttemptResult:
        """Another node failed, was lost, or was asked to stop: this node's ranks stop too."""
        attempt = machine.attempt
        self._events.emit(PeerInterrupt(attempt, remote.node, remote.kind.value, remote.detail))
        if remote.kind is InterruptKind.STOP:
            self._say(f"attempt {attempt}: node {remote.node} was asked to stop; stopping with it")
            self._ask_to_stop(attempt, group, board, channel, rate)
            return self._stopped_by_signal(attempt, remote.signum)
        cause = f"node {remote.node}: {remote.detail}"
        self._say(f"attempt {attempt}: stopping this node's workers ({cause})")
        machine.transition(GroupState.FAILED, root_cause=cause)
        return AttemptResult(attempt, AttemptOutcome.FAILED, cause=cause)

    def _ask_to_stop(self, attempt: int, group: WorkerGroup, board: HeartbeatBoard, channel, rate) -> None:
        """When every rank calls ft.should_stop(step), give them the grace period to reach a step
        chosen for all (past the furthest: none can have checked it yet), save it and leave,
        before any signal reaches them. A second signal ends the wait."""
        running = group.running()
        slots = board.read()
        aware = bool(running) and all(slots[rank].stop_aware for rank in running)
        furthest = max((slots[rank].step for rank in running), default=-1)
        if channel is not None:  # every node's ranks stop at one step, or none is asked
            reading = {"aware": aware, "furthest": furthest, "rate": rate.rate} if running else None
            at_step = channel.agree_stop_step(reading, self._signals.wait)
        else:
            at_step = furthest + 2 if aware else 0
        if not running or at_step <= 0:
            return  # a rank that would not stop would leave the others blocked in a collective
        board.request_stop(at_step)
        grace = self.config.grace_period
        self._events.emit(StopRequested(attempt, at_step))
        self._say(
            f"asking the workers to save and stop at step {at_step} (up to {grace:g} s; Ctrl+C again: now)"
        )
        _warn_if_past(board.read(), running, at_step, self._say)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self._stop_cut_short():
            for exited in group.poll():
                self._record_exit(attempt, exited, [])  # an event; exits here are not failures
            if group.all_exited():
                return
            self._signals.wait(_MONITOR_TIMEOUT_S)

    def _publish_progress(self, attempt: int, group: WorkerGroup, slots, channel) -> None:
        """Every few seconds: node 0 writes every node's ranks to the run dir; the others share
        theirs with node 0 through the store."""
        now = time.monotonic()
        if now < self._next_progress:
            return
        self._next_progress = now + (_PROGRESS_EVERY_S if self._run is not None else _SHARE_EVERY_S)
        rows = progress_rows(slots, group.running(), now)
        if self._run is None:
            if channel is not None:
                channel.share_progress(rows)
        elif channel is None:
            self._run.publish_progress(attempt, rows)
        else:
            self._run.publish_progress(attempt, *channel.job_progress(rows))

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
                    node=self.config.node_rank if self.config.many_nodes else None,
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

    def _spawning_may_go_on(self) -> bool:
        """Asked between two spawns: the lease stays fresh however many ranks start, and a signal
        stops the rest from starting (the monitor then stops those already running)."""
        if self._run is not None:
            self._run.keep_alive(time.time())
        return self._signals.first is None

    def _keep_guard(self) -> None:
        dead = self._guard.restart_if_dead()
        if dead is not None:
            self._events.emit(GuardRestarted(dead_pid=dead, new_pid=self._guard.pid))
            self._say(
                f"the orphan guard (pid {dead}) died; a new one (pid {self._guard.pid}) watches the workers"
            )

    def _stopped_by_signal(self, attempt: int, signum: int) -> AttemptResult:
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

    def _on_transition(self, attempt: int, old: Optional[GroupState], new: GroupState, **details) -> None:
        self._events.emit(Transition(attempt, old, new, **details))
        log.info("attempt %s: %s -> %s", attempt, old and old.value, new.value)
        if new is GroupState.RUNNING and self._run is not None:  # off the recovery's critical path
            self._run.save()


def _warn_if_past(slots: dict, running: dict, at_step: int, say: Callable[[str], None]) -> None:
    """A rank already past the stop step when asked stops later than the others: their saves
    will not match. Said, so that a missing checkpoint is explained."""
    past = sorted(rank for rank in running if slots[rank].step >= at_step)
    if past:
        say(f"rank(s) {past} were already at step {at_step} or past it; they stop where they are")
