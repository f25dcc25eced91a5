"""How one node's group stops: asked by another node (a failure there, a stop, a resize), the
cooperative stop (the ranks save at one agreed step and leave), the signals and the grace period,
and the kill after an error of the supervisor's own. The attempt runner decides when; this acts."""

import signal
from typing import Callable, List, Optional

from launcher.cluster.wire import Interrupt, InterruptKind
from launcher.core.events import PeerInterrupt, StopRequested
from launcher.core.failures import Failure
from launcher.core.group_state import ALLOWED_TRANSITIONS, GroupState, GroupStateMachine
from launcher.core.outcomes import AttemptOutcome
from launcher.core.results import AttemptResult
from launcher.core.stopping import CooperativeStop, StepRate
from launcher.hangs.board import HeartbeatBoard
from launcher.process.kit import NodeKit
from launcher.process.waiting import LOOK_S
from launcher.process.workers import Exit, WorkerGroup
from launcher.roles.link import PeerLink

__all__ = ["GroupStop", "stopped_by_signal"]


def stopped_by_signal(attempt: int, signum: Optional[int], name: str = "") -> AttemptResult:
    """``name``: the signal as the node that received it names it (``SignalInbox.name_of``)."""
    return AttemptResult(attempt, AttemptOutcome.stopped_by(signum), signum=signum, signal_name=name)


class GroupStop:
    """``grace``: --grace-period; ``alone``: the only node of the job;
    ``record_exit(attempt, exited, failures)``: the runner's record of a rank's exit."""

    def __init__(
        self,
        kit: NodeKit,
        grace: float,
        alone: bool,
        record_exit: Callable[[int, Exit, List[Failure]], None],
    ) -> None:
        self._events, self._signals, self._say = kit.events, kit.signals, kit.say
        self._grace = grace
        self._alone = alone
        self._record_exit = record_exit

    def by_peer(
        self,
        machine: GroupStateMachine,
        group: WorkerGroup,
        board: HeartbeatBoard,
        rate: StepRate,
        remote: Interrupt,
        link: PeerLink,
    ) -> AttemptResult:
        """Another node failed, was lost, or was asked to stop: this node's ranks stop too."""
        attempt = machine.attempt
        self._events.emit(PeerInterrupt(attempt, remote.node, remote.kind.value, remote.detail))
        if remote.kind is InterruptKind.STOP:
            self._say(f"attempt {attempt}: node {remote.node} was asked to stop; stopping with it")
            self.ask(attempt, group, board, rate, link)
            # A signal of this node's own meanwhile is the same request (SLURM signals every node).
            self._signals.answer_first()
            return stopped_by_signal(attempt, remote.signum, remote.detail)  # its receiver's name for it
        if remote.kind is InterruptKind.RESIZE:
            self._say(f"attempt {attempt}: {remote.detail}; the group stops to restart with it")
            if not self.ask(attempt, group, board, rate, link) and group.running():
                # Nothing says where the script saves: stop now, as torchrun restarts its workers
                # for a waiting node; what its ranks did since their own last save is redone.
                self._say(
                    f"attempt {attempt}: not every rank calls ft.should_stop, so none can be asked to "
                    "save first: the workers are stopped now and restart on the larger job at once"
                )
            return AttemptResult(
                attempt, AttemptOutcome.RESIZED, cause=f"node {remote.node}: {remote.detail}"
            )
        cause = f"node {remote.node}: {remote.detail}"
        self._say(f"attempt {attempt}: stopping this node's workers ({cause})")
        machine.transition(GroupState.FAILED, root_cause=cause)
        return AttemptResult(attempt, AttemptOutcome.FAILED, cause=cause)

    def ask(
        self, attempt: int, group: WorkerGroup, board: HeartbeatBoard, rate: StepRate, link: PeerLink
    ) -> int:
        """When every rank calls ft.should_stop(step), give them the grace period to reach a step
        chosen for all, save it and leave, before any signal reaches them. Returns that step (0:
        none was asked)."""

        def turn() -> bool:
            for exited in group.poll():
                self._record_exit(attempt, exited, [])  # an event; exits here are not failures
            if group.all_exited():
                return True
            self._signals.wait(LOOK_S)  # a wait's look, as every wait's
            return False

        stop = CooperativeStop(self._grace, link.agree_stop_step, self.cut_short, self._say)
        return stop.ask(
            group, board, rate, lambda step: self._events.emit(StopRequested(attempt, step)), turn
        )

    def stop(
        self, machine: GroupStateMachine, group: WorkerGroup, result: AttemptResult, may_restart: bool
    ) -> None:
        """Stop the whole group. After a success this only sweeps up leftover grandchildren.
        ``may_restart``: the policy may restart after it (the next ranks are forked meanwhile)."""
        succeeded = result.outcome is AttemptOutcome.SUCCEEDED
        if not succeeded:
            machine.transition(GroupState.STOPPING)
        first_signal = result.signum if result.outcome.stopped_by_signal and result.signum else signal.SIGTERM
        grace = self._grace
        # One node alone forks the next group while this one exits. A node of many waits for the
        # job's verdict (AttemptRunner.concluded): its forks would take the CPU that nodes sharing
        # its machine need to hear of the crash (16 loopback nodes: every node's ranks stopped in
        # 0.24-0.32 s after it, against 0.13-0.15 s), and the rendezvous after the verdict is the
        # long part of its restart, which they still overlap.
        ahead = may_restart and self._alone
        report = group.stop(first_signal, grace, self.cut_short, restarting=ahead)
        if report.survivors:
            self._say(f"could not stop pids {report.survivors} (uninterruptible?); left behind")
        if not succeeded:
            machine.transition(
                GroupState.STOPPED,
                killed=report.killed,
                seconds=round(report.seconds, 3),
                survivors=report.survivors,
            )

    def kill(self, machine: GroupStateMachine, group: WorkerGroup) -> None:
        """Whatever went wrong in the supervisor itself, no worker outlives this attempt."""
        if GroupState.STOPPING in ALLOWED_TRANSITIONS[machine.state]:
            machine.transition(GroupState.STOPPING)
        group.stop(signal.SIGKILL, 0.0, abort=lambda: True)
        if machine.state is GroupState.STOPPING:
            machine.transition(GroupState.STOPPED, killed=True)

    def cut_short(self) -> bool:
        """A second Ctrl+C (or any second signal) skips the rest of the grace period."""
        return len(self._signals.received) >= 2
