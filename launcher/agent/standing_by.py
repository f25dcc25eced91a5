"""A standby node's attempt (--standby-nodes): no rank runs; its fork server stays warm and what a
restart starts from is forked ahead. It watches the other nodes until the attempt ends (another
node's interrupt, node 0's verdict) or a signal comes, which stops the job as on any node."""

from launcher.agent.group_stop import stopped_by_signal
from launcher.cluster.wire import InterruptKind
from launcher.core.events import AttemptPlanned
from launcher.core.outcomes import AttemptOutcome
from launcher.core.results import AttemptResult
from launcher.process.kit import NodeKit
from launcher.process.workers import Spawner
from launcher.roles.link import PeerLink
from launcher.roles.role import AttemptPlan

__all__ = ["stand_by"]

_LOOK_S = 0.05  # as an attempt's monitor looks: a signal wakes it at once


def stand_by(plan: AttemptPlan, link: PeerLink, kit: NodeKit, spawner: Spawner) -> AttemptResult:
    attempt, layout = plan.attempt, plan.layout
    kit.events.emit(AttemptPlanned(attempt, layout.world_size, list(layout.nodes), []))
    spawner.fork_ahead()  # what taking a place would start from, made while it waits
    while True:
        spawner.settle_ahead()
        if kit.signals.first is not None:
            signum = kit.signals.first
            name = kit.signals.name_of(signum)
            kit.signals.answer_first()
            link.interrupt(InterruptKind.STOP, name, signum)
            return stopped_by_signal(attempt, signum, name)
        if link.tick() is not None or link.decided():
            return AttemptResult(attempt, AttemptOutcome.SUCCEEDED)  # nothing of its own ran
        link.keep_alive()
        kit.signals.wait(_LOOK_S)
