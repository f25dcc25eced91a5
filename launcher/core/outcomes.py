"""How attempts and runs end: one vocabulary, stored in run.json by value, compared as enums.

An attempt's group moves through ``GroupState`` while it lives; when it is over, the attempt has
one ``AttemptOutcome``. The run as a whole has a ``RunStatus``: RUNNING while a supervisor holds
it, then the status its last attempt (or the policy) ended it with.
"""

import enum
import signal
from typing import Optional

__all__ = ["AttemptOutcome", "RunStatus"]


class AttemptOutcome(str, enum.Enum):
    SUCCEEDED = "SUCCEEDED"  # every rank exited 0
    FAILED = "FAILED"  # a rank crashed or hung
    INTERRUPTED = "INTERRUPTED"  # SIGINT/SIGHUP to ftlaunch
    PREEMPTED = "PREEMPTED"  # SIGTERM to ftlaunch: the scheduler wants the node back
    SUPERVISOR_LOST = "SUPERVISOR_LOST"  # its supervisor died; found by the next one
    RESIZED = "RESIZED"  # --nnodes MIN:MAX: a node was lost or waits to join; not a failure
    NODE_LOST = "NODE_LOST"  # a fixed-size job lost a node's supervisor (dead or frozen); not a failure

    @classmethod
    def stopped_by(cls, signum: Optional[int]) -> "AttemptOutcome":
        return cls.PREEMPTED if signum == signal.SIGTERM else cls.INTERRUPTED

    @property
    def stopped_by_signal(self) -> bool:
        return self in (AttemptOutcome.INTERRUPTED, AttemptOutcome.PREEMPTED)

    @property
    def may_restart(self) -> bool:
        """Whether a group that ended so is most often followed by another (a failure within the
        budget, a change of nodes): what is made ahead for it is otherwise let go at the end."""
        return self in (AttemptOutcome.FAILED, AttemptOutcome.RESIZED, AttemptOutcome.NODE_LOST)


class RunStatus(str, enum.Enum):
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # budget spent, or a crash loop
    STOPPED = "STOPPED"  # interrupted (SIGINT, SIGHUP)
    PREEMPTED = "PREEMPTED"  # SIGTERM: relaunch to resume

    @classmethod
    def ended_by(cls, last: AttemptOutcome) -> "RunStatus":
        """The run's status when ``last`` is the attempt it ends with."""
        return {
            AttemptOutcome.SUCCEEDED: cls.SUCCEEDED,
            AttemptOutcome.PREEMPTED: cls.PREEMPTED,
            AttemptOutcome.INTERRUPTED: cls.STOPPED,
        }.get(last, cls.FAILED)
