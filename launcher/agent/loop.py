"""The agent's loop: one attempt after another until the node's role decides the run is over."""

from typing import List, Protocol

from launcher.core.results import AttemptResult, RunResult
from launcher.grammar.errors import (
    JoinTimeout,
    NodeUnhealthy,
    SignalReceived,
    StandbyReleased,
    StartFailed,
    UsageError,
)
from launcher.roles.link import PeerLink
from launcher.roles.role import AttemptPlan, NodeRole

__all__ = ["Attempts", "Health", "run_attempts"]


class Attempts(Protocol):
    """What the loop asks of the attempts (``agent.attempt.AttemptRunner``)."""

    def warm_up(self) -> None: ...

    def run(self, plan: AttemptPlan, link: PeerLink) -> AttemptResult: ...

    def concluded(self, result: AttemptResult, restarting: bool) -> None: ...


class Health(Protocol):
    """What the loop asks of the node's health check (``agent.health.NodeHealth``)."""

    def check(self, restart: bool) -> None: ...


class _Unchecked:
    def check(self, restart: bool) -> None:
        pass


UNCHECKED = _Unchecked()  # a loop without health checks (unit tests of the roles)


def run_attempts(role: NodeRole, runner: Attempts, health: Health = UNCHECKED) -> RunResult:
    """check → meet → run (start, watch, stop) → conclude → decide → announce → (pause, again |
    end). An unhealthy node never joins the next attempt (NodeUnhealthy: exit 8)."""
    attempts: List[AttemptResult] = []
    runner.warm_up()
    while True:
        try:
            health.check(restart=bool(attempts))
            plan = role.meet()
        except (SignalReceived, JoinTimeout, NodeUnhealthy, StandbyReleased) as err:
            return role.ended_waiting(err, attempts)
        try:
            local = runner.run(plan, role.link)
        except StartFailed as err:
            role.not_started(err)
            if not attempts:  # nothing of this launch ran, nothing was written: bad input
                raise UsageError(str(err)) from None
            raise
        concluded = role.conclude(local)
        attempts.append(concluded.result)
        ended, delay = role.decide(concluded, attempts)
        role.announce(concluded, ended, delay)
        runner.concluded(concluded.result, restarting=ended is None)
        if ended is not None:
            return ended
        role.pause(delay)
