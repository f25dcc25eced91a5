"""The agent's loop: one attempt after another until the node's role decides the run is over."""

from typing import List, Protocol

from launcher.core.results import AttemptResult, RunResult
from launcher.grammar.errors import JoinTimeout, SignalReceived, StartFailed, UsageError
from launcher.roles.link import PeerLink
from launcher.roles.role import AttemptPlan, NodeRole

__all__ = ["Attempts", "run_attempts"]


class Attempts(Protocol):
    """What the loop asks of the attempts (``agent.attempt.AttemptRunner``)."""

    def warm_up(self) -> None: ...

    def run(self, plan: AttemptPlan, link: PeerLink) -> AttemptResult: ...

    def concluded(self, result: AttemptResult, restarting: bool) -> None: ...


def run_attempts(role: NodeRole, runner: Attempts) -> RunResult:
    """meet → run (start, watch, stop) → conclude → decide → announce → (pause, again | end)."""
    attempts: List[AttemptResult] = []
    runner.warm_up()
    while True:
        try:
            plan = role.meet()
        except (SignalReceived, JoinTimeout) as err:
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
