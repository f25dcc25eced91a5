"""One attempt on this node: spawn the local ranks, watch them, stop them. The same mechanics on
one node and on each node of many; what the attempt's end means for the run is decided by node 0
from what every node reports."""

import dataclasses
import logging
import time
import traceback
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

from launcher.agent.copies import NO_COPIES, NoCopies
from launcher.agent.group_stop import GroupStop, stopped_by_signal
from launcher.agent.standing_by import stand_by
from launcher.chaos.driver import NoChaos
from launcher.cluster.wire import InterruptKind
from launcher.core import failpoints
from launcher.core.beats import BeatReading, BeatSummary, Entered
from launcher.core.events import (
    AttemptEnded,
    AttemptPlanned,
    GroupsGuarded,
    GuardRestarted,
    InternalError,
    Transition,
    WorkerExit,
)
from launcher.core.failures import (
    Failure,
    HangFailure,
    NodeLostFailure,
    ProcessFailure,
    read_error_file,
    root_cause,
)
from launcher.core.group_state import GroupState, GroupStateMachine
from launcher.core.outcomes import AttemptOutcome
from launcher.core.results import AttemptResult
from launcher.core.stopping import StepRate
from launcher.grammar.errors import FtlaunchError, StartFailed
from launcher.hangs.board import HeartbeatBoard
from launcher.hangs.deadlines import Overdue
from launcher.hangs.monitor import HangMonitor, hang_failures, progress_rows
from launcher.hangs.stacks import main_thread_stack
from launcher.observe.slots import SlotObserver
from launcher.process.kit import NodeKit
from launcher.process.logs import LogPump, tail_lines
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import WorkerPlan, plan_workers
from launcher.process.workers import Exit, Spawner, WorkerGroup
from launcher.roles.link import PeerLink
from launcher.roles.role import AttemptPlan

__all__ = ["AttemptRunner", "Workers"]

log = logging.getLogger(__name__)

# The loop sleeps in select() on the signal pipe; SIGCHLD wakes it the moment a worker dies.
# The timeout only bounds how long a missed wakeup could go unnoticed (and, with many nodes,
# how often the other nodes' news is looked at).
_MONITOR_TIMEOUT_S = 0.05
_LOG_TAIL_LINES = 20


@dataclasses.dataclass(frozen=True)
class Workers:
    """How this node's ranks are made and kept: what they run, the spawner, the orphan guard that
    outlives the supervisor, the console their lines go to, and the node's memory tier."""

    plan: WorkerPlan
    spawner: Spawner
    guard: OrphanGuard
    console: Tuple[BinaryIO, BinaryIO]
    memory_dir: Optional[Path] = None  # the node's memory tier, for the workers' snapshots
    copies: NoCopies = NO_COPIES  # the tier's copies to and from other nodes


class AttemptRunner:
    """Runs one attempt's local worker group from spawn to stop. What the other nodes (if any) do
    reaches it through the attempt's ``PeerLink``. ``node``: this node's rank in a job of many
    nodes (None: the only node)."""

    def __init__(
        self, kit: NodeKit, workers: Workers, hangs: HangMonitor, chaos: NoChaos, node: Optional[int]
    ) -> None:
        self._kit = kit
        self._events, self._signals, self._say = kit.events, kit.signals, kit.say
        self._group = workers.plan.group
        self._plan = workers.plan
        self._guard = workers.guard
        self._spawner = workers.spawner
        self._console = workers.console
        self._memory_dir = workers.memory_dir
        self._copies = workers.copies
        self._hangs = hangs
        self._chaos = chaos
        self._node = node
        self._next_progress = 0.0
        self._link: Optional[PeerLink] = None  # the attempt's, during run(): see ``link``
        self._observer = SlotObserver(kit.events, -1)  # the slots as events: one per attempt
        self._logs_cut_said = False
        self._board_fallback_said = False
        self._stops = GroupStop(kit, self._group.grace_period, node is None, self._record_exit)

    @property
    def link(self) -> PeerLink:
        """The attempt's link to the other nodes, while ``run`` runs it."""
        if self._link is None:
            raise RuntimeError("the attempt runner's link is asked for outside run()")
        return self._link

    def warm_up(self) -> None:
        """Let the spawner (a fork server importing torch) get going while the supervisor sets up
        the first attempt (its store, the nodes' rendezvous), which imports torch too: the two
        imports overlap. A zygote's environment leaves out what differs per attempt."""
        self._spawner.warm_up(plan_workers(self._plan, 0, master_port=0)[0])

    def run(self, plan: AttemptPlan, link: PeerLink) -> AttemptResult:
        self._link = link
        restored = self._copies.begin(plan, go_on=lambda: self._signals.first is None)
        return dataclasses.replace(self._run(plan, link), restored=restored)

    def _run(self, plan: AttemptPlan, link: PeerLink) -> AttemptResult:
        if not plan.layout.trains:
            return stand_by(plan, link, self._kit, self._spawner)
        attempt = plan.attempt
        machine = GroupStateMachine(attempt, self._on_transition)
        layout = plan.layout
        board = HeartbeatBoard(self._group.nproc, attempt, first_rank=layout.rank(0))
        if board.fallback and not self._board_fallback_said:
            self._board_fallback_said = True
            self._say(f"heartbeat slots in {board.path.parent}: {board.fallback}")
        pump = LogPump(*self._console, cut=self._logs_cut)
        specs = plan_workers(
            self._plan,
            attempt,
            plan.master_port,
            heartbeat_file=board.path,
            master_addr=plan.master_addr,
            layout=layout,
            memory_dir=self._memory_dir,
        )
        group = WorkerGroup(specs, self._spawner, pump, self._guard, self._group.shows_on_console)
        ranks = [spec.rank for spec in specs]
        self._events.emit(AttemptPlanned(attempt, layout.world_size, list(layout.nodes), ranks))
        self._observer = SlotObserver(self._events, attempt)
        failpoints.reached("planned")
        group.prepare(self._spawning_may_go_on)
        started = time.monotonic()
        self._chaos.attempt_started(layout)
        try:
            result = self._start_and_watch(machine, group, board)
            lived = time.monotonic() - started
            result = _with_exits_before_the_stop(result, group, self._record_exit)
            self._stops.stop(machine, group, result, may_restart=link.may_restart(result))
            slots = board.read()
            self._observer.final(slots, board.checkpoint_counters())
            entered = {r: Entered(s.collective, s.collective_kind, self._node) for r, s in slots.items()}
            result = dataclasses.replace(
                result,
                lived=lived,
                beats=BeatSummary.of(slots.values()),
                collectives={r: e for r, e in entered.items() if e.seq >= 0},  # -1: not known
            )
        except FtlaunchError:
            self._stops.kill(machine, group)
            raise
        except BaseException as err:  # a defect of ours: recorded, the workers stopped, said, raised
            self._events.emit(InternalError(attempt, _one_line(err), traceback.format_exc()))
            self._stops.kill(machine, group)
            self._say(f"attempt {attempt}: internal error ({_one_line(err)}); this node's workers stopped")
            raise
        finally:
            pump.close()
            board.close()
        result = _with_log_tails(result)
        return dataclasses.replace(result, failures=self._chaos.mark(result.failures))

    def _start_and_watch(
        self, machine: GroupStateMachine, group: WorkerGroup, board: HeartbeatBoard
    ) -> AttemptResult:
        if self._signals.first is not None:  # interrupted between two attempts
            signum = self._signals.first
            name = self._signals.name_of(signum)
            self._signals.answer_first()
            # The other nodes were planned with this one and start their ranks: they must stop
            # too, now, not once this node has gone silent for --node-timeout.
            self.link.interrupt(InterruptKind.STOP, name, signum)
            return stopped_by_signal(machine.attempt, signum, name)
        self._say(
            f"attempt {machine.attempt}: starting {self._group.nproc} worker(s), "
            f"backend {self._group.backend}, logs in {group.specs[0].log_file.parent}"
        )
        try:
            group.spawn(go_on=self._spawning_may_go_on)
        except OSError as err:
            machine.transition(GroupState.FAILED, error=str(err))
            raise StartFailed(f"cannot start the workers: {err}") from None
        machine.transition(GroupState.RUNNING, pids=group.pids)
        return self._monitor(machine, group, board)

    def _monitor(
        self, machine: GroupStateMachine, group: WorkerGroup, board: HeartbeatBoard
    ) -> AttemptResult:
        failures: List[Failure] = []
        watch = self._hangs.watch_attempt()
        rate = StepRate()
        attempt, link = machine.attempt, self.link
        while True:
            if self._signals.first is not None:
                signum = self._signals.first
                name = self._signals.name_of(signum)
                self._signals.answer_first()
                link.interrupt(InterruptKind.STOP, name, signum)  # the others name it as this node does
                self._stops.ask(attempt, group, board, rate, link)
                return stopped_by_signal(attempt, signum, name)
            for exited in group.poll():
                self._record_exit(attempt, exited, failures)
            if failures:
                cause = root_cause(failures)
                machine.transition(
                    GroupState.FAILED, root_cause=cause.describe(), failed_at=cause.observed_at
                )
                link.interrupt(InterruptKind.FAILURE, cause.describe())
                return AttemptResult(attempt, AttemptOutcome.FAILED, failures)
            if group.all_exited():
                machine.transition(GroupState.SUCCEEDED)
                return AttemptResult(attempt, AttemptOutcome.SUCCEEDED)
            # Another node's interrupt before this node's own bookkeeping (its beat, the orphan
            # guard's look, the slots, the progress): every node stops its ranks as soon as it can.
            remote = link.tick()
            if remote is not None:
                return self._stops.by_peer(machine, group, board, rate, remote, link)
            link.keep_alive()
            self._keep_guard(attempt, group)
            slots = board.read()
            self._chaos.inject(attempt, group, board, slots)
            rate.observe(time.monotonic(), BeatSummary.of(slots.values()).furthest_step)
            self._hangs.look_at_work(time.monotonic(), board.own_work)
            self._publish_progress(attempt, group, slots)
            self._observer.look(time.monotonic(), slots, group.running(), board.checkpoint_counters)
            overdue = self._hangs.check(watch, attempt, group.running(), slots)
            if overdue:
                hung = _hang_failures(group, overdue, slots)
                cause = root_cause(hung)
                machine.transition(GroupState.HUNG, ranks=[f.rank for f in hung], failed_at=cause.observed_at)
                link.interrupt(InterruptKind.FAILURE, cause.describe())
                return AttemptResult(attempt, AttemptOutcome.FAILED, hung)
            self._signals.wait(_MONITOR_TIMEOUT_S)

    def concluded(self, result: AttemptResult, restarting: bool) -> None:
        """The job's outcome of an attempt (every node's reports merged), for the run log. On a
        node of many, a restart's processes are forked from here, while the nodes meet again
        (one node alone forked them during its stop: ``GroupStop.stop``)."""
        if restarting and self._node is not None:
            self._spawner.fork_ahead()
        cause = result.root_cause
        kind = ""
        if result.outcome is AttemptOutcome.FAILED:
            kinds = {ProcessFailure: "crash", HangFailure: "hang", NodeLostFailure: "lost_node"}
            kind = kinds.get(type(cause), "unknown")
        self._events.emit(
            AttemptEnded(
                result.attempt,
                result.outcome.value,
                kind,
                rank=cause.rank if cause is not None else None,
                node=cause.node if cause is not None else None,
                injected=bool(getattr(cause, "injected", False)),
                restarting=restarting,
            )
        )

    def _publish_progress(self, attempt: int, group: WorkerGroup, slots: Dict[int, BeatReading]) -> None:
        """Every few seconds (the link says how often): the live ranks' steps, for `ftlaunch status`."""
        now = time.monotonic()
        if now < self._next_progress:
            return
        self._next_progress = now + self.link.progress_every_s
        rows = progress_rows(slots, group.running(), now, self._hangs.own_work())
        job = self.link.publish_progress(attempt, rows, self._copies.note(attempt))
        if job is not None:  # this node holds the run: it judges every rank of the job
            self._hangs.judge_stragglers(attempt, job.ranks, job.hosts)

    def _record_exit(self, attempt: int, exited: Exit, failures: List[Failure]) -> None:
        self._events.emit(
            WorkerExit(attempt, exited.spec.rank, exited.pid, exited.exitcode, exited.observed_at)
        )
        if exited.exitcode != 0:
            failures.append(_failure_of(exited, self._node))

    def _spawning_may_go_on(self) -> bool:
        """Asked between two spawns: the lease stays fresh however many ranks start, and a signal
        stops the rest from starting (the monitor then stops those already running)."""
        self.link.keep_alive()
        return self._signals.first is None

    def _keep_guard(self, attempt: int, group: WorkerGroup) -> None:
        guarded = group.guard_new_groups()
        if guarded:
            self._events.emit(GroupsGuarded(attempt, guarded))
        dead = self._guard.restart_if_dead()
        if dead is not None:
            self._events.emit(GuardRestarted(dead_pid=dead, new_pid=self._guard.pid))
            self._say(
                f"the orphan guard (pid {dead}) died; a new one (pid {self._guard.pid}) watches the workers"
            )

    def _logs_cut(self, path: str, err: OSError) -> None:
        """A rank's log file could not be written (a full disk): said once a run; it goes on.
        Called from the log pump's thread."""
        if not self._logs_cut_said:
            self._logs_cut_said = True
            self._say(
                f"logs cut: cannot write {path} ({err.strerror or err}); the workers' lines still reach "
                "the console (the ranks shown there), and the run goes on"
            )

    def _on_transition(
        self, attempt: int, old: Optional[GroupState], new: GroupState, **details: Any
    ) -> None:
        self._events.emit(Transition(attempt, old, new, **details))
        log.info("attempt %s: %s -> %s", attempt, old and old.value, new.value)
        if new is GroupState.RUNNING:
            self.link.group_running()


def _with_exits_before_the_stop(
    result: AttemptResult, group: WorkerGroup, record: Callable[[int, Exit, List[Failure]], None]
) -> AttemptResult:
    """One more look at a failed group's ranks before the stop signals them: those that died
    since the look that saw the failure (eight ranks killed at once: it saw one or two) died of
    their own, and are failures of the attempt too. One that dies after the stop's signal may have
    died of it (a handler that turns SIGTERM into KeyboardInterrupt ends by SIGINT): that is no
    evidence, and is not counted."""
    if result.outcome is not AttemptOutcome.FAILED or not result.failures:
        return result
    failpoints.reached("failure-seen")
    late: List[Failure] = []
    for exited in group.poll():
        record(result.attempt, exited, late)
    return dataclasses.replace(result, failures=[*result.failures, *late]) if late else result


def _failure_of(exited: Exit, node: Optional[int]) -> ProcessFailure:
    return ProcessFailure(
        rank=exited.spec.rank,
        local_rank=exited.spec.local_rank,
        pid=exited.pid,
        exitcode=exited.exitcode,
        observed_at=exited.observed_at,
        error=read_error_file(exited.spec.error_file),
        log_file=exited.spec.log_file,
        node=node,
    )


def _with_log_tails(result: AttemptResult) -> AttemptResult:
    """Attach each failed rank's last log lines (and a hung rank's stack), now that the log
    pump has drained."""
    failures: List[Failure] = []
    for f in result.failures:
        if isinstance(f, (ProcessFailure, HangFailure)) and f.log_file:
            f = dataclasses.replace(f, log_tail=tuple(tail_lines(f.log_file, _LOG_TAIL_LINES)))
        if isinstance(f, HangFailure) and f.log_file:
            f = dataclasses.replace(f, stack=main_thread_stack(f.log_file, f.thread_id))
        failures.append(f)
    return dataclasses.replace(result, failures=failures)


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def _hang_failures(
    group: WorkerGroup, overdue: List[Overdue], slots: Dict[int, BeatReading]
) -> List[Failure]:
    """The monitor's decision acted on: every rank that can writes its stacks, then the hung ranks
    become failures with their process state as evidence."""
    running = group.running()
    signals = {rank: (r.pid, r.dump_signal) for rank, r in slots.items() if r.dump_signal}
    statuses = group.dump_stacks(signals)
    where = {spec.rank: (spec.local_rank, spec.log_file) for spec in group.specs}
    return hang_failures([o for o in overdue if o.rank in running], running, slots, where, statuses)
