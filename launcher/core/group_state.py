"""The worker group's state machine: one object per attempt, every transition an event."""

import enum
from typing import Callable, Dict, FrozenSet

__all__ = ["GroupState", "ALLOWED_TRANSITIONS", "GroupStateMachine", "IllegalTransition"]


class GroupState(str, enum.Enum):
    """States of one attempt's worker group.

    ::

        STARTING ──► RUNNING ──► SUCCEEDED                 (every rank exited 0)
           │            ├──────► FAILED ──► STOPPING ──► STOPPED
           │            ├──────► HUNG ────► STOPPING       (heartbeat deadline missed)
           │            └──────────────────► STOPPING      (ftlaunch was interrupted)
           └──► FAILED (a rank could not be spawned)

    SUCCEEDED and STOPPED are terminal; a restart is a new attempt with a new machine.
    """

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    HUNG = "HUNG"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"

    def is_terminal(self) -> bool:
        return self in (GroupState.SUCCEEDED, GroupState.STOPPED)


ALLOWED_TRANSITIONS: Dict[GroupState, FrozenSet[GroupState]] = {
    GroupState.STARTING: frozenset({GroupState.RUNNING, GroupState.FAILED, GroupState.STOPPING}),
    GroupState.RUNNING: frozenset(
        {GroupState.SUCCEEDED, GroupState.FAILED, GroupState.HUNG, GroupState.STOPPING}
    ),
    GroupState.FAILED: frozenset({GroupState.STOPPING}),
    GroupState.HUNG: frozenset({GroupState.STOPPING}),
    GroupState.STOPPING: frozenset({GroupState.STOPPED}),
    GroupState.SUCCEEDED: frozenset(),
    GroupState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug in the supervisor: it asked for a transition the table does not allow."""


class GroupStateMachine:
    """Holds one attempt's state; reports each transition to ``on_transition``."""

    def __init__(self, attempt: int, on_transition: Callable[..., None]) -> None:
        self.attempt = attempt
        self.state = GroupState.STARTING
        self._on_transition = on_transition
        on_transition(attempt=attempt, old=None, new=self.state)

    def transition(self, new: GroupState, **details: object) -> None:
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(f"attempt {self.attempt}: {self.state.value} -> {new.value}")
        old, self.state = self.state, new
        self._on_transition(attempt=self.attempt, old=old, new=new, **details)
