"""Named moments (of the many-node protocol, and one of a node's own) where a test can freeze this
supervisor, so that it can act exactly there: ``FTLAUNCH_FAILPOINT=round-joined`` (a comma-separated
list of names) in the supervisor's environment makes it print ``ftlaunch failpoint <name>`` on
stderr and stop itself (SIGSTOP) when it reaches that moment; the test sees the process stopped,
then acts. Read once, at import; no other effect. Not for users: a moment in the protocol is not an interface.

    before-round    a follower is in the lobby and about to join a rendezvous round
    round-joined    a follower's round is complete; it has not announced itself yet
    announced       a follower announced itself; it has not read node 0's plan yet
    planned         a node holds its attempt's plan; its ranks have not started
    failure-seen    a node saw a rank fail; it has not looked at the others again, nor stopped them
    stop-signalled  a node's group (any, a succeeded one's sweep too) got its stop's first signal,
                    and the next group's processes were asked for where a restart may follow
"""

import os
import signal
import sys

__all__ = ["MEETING", "POINTS", "reached"]

# The moments every healthy meeting passes (a chaos trial may freeze any of them); a rank's failure
# is not one of them.
MEETING = ("before-round", "round-joined", "announced", "planned")
POINTS = (*MEETING, "failure-seen", "stop-signalled")
_ARMED = frozenset(name for name in os.environ.get("FTLAUNCH_FAILPOINT", "").split(",") if name)


def reached(name: str) -> None:
    """This process is at moment ``name``: freeze here if a test asked for it."""
    assert name in POINTS, name
    if name in _ARMED:
        print(f"ftlaunch failpoint {name}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
