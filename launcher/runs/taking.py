"""Taking the run at launch when its lock names a supervisor on another host whose lease has not
expired. Only the lease can tell whether that supervisor lives; a requeued job lands on another
node moments after its supervisor there was killed, and a refusal (exit 2) is never requeued. So
the launch watches the lock until the lease expires (taken over) or is renewed (alive: refused)."""

import math
import time
from typing import Callable, Optional

from launcher.core.owned import pid_space
from launcher.grammar.errors import RunBusy
from launcher.process.waiting import Inbox, Wait
from launcher.runs.directory import LockRecord, RunDir

__all__ = ["take"]

_MARGIN_S = 0.5  # past the lease's end: the holder's clock and ours read a little apart
_LOOK_S = 1.0  # the lock is read this often while waiting (a renewal comes every lease/3)
_MOST_S = 600.0  # a lease that ends later is refused at once, as before there was a wait


def take(directory: RunDir, lease: float, signals: Inbox, say: Callable[[str], None]) -> Optional[LockRecord]:
    """Hold the run (``RunDir.acquire``), first waiting out another host's unexpired lease;
    RunBusy once that holder renewed it, SignalReceived for a signal since the launch began.
    Returns the dead or expired holder taken over from, if any."""
    held = directory.read_lock()
    if held is None or held.host == pid_space() or held.expired(time.time()):
        return directory.acquire(lease)
    # Until its end, and never longer than a whole lease: a live holder renews within a third of
    # it, whatever its clock says (a renewal time in our future is its clock's, not a promise).
    left = min(held.renewed_at + held.lease - time.time(), held.lease) + _MARGIN_S
    if left > _MOST_S:  # a lease of hours is its holder's wish to keep the run: refused, as it asks
        return directory.acquire(lease)
    wait = Wait(left, signals, since=0, look=_LOOK_S)  # a signal since the launch began ends it too
    wait.check_signals()
    say(
        f"run {directory.url} is held by {held.describe(time.time())}: "
        f"waiting up to {math.ceil(wait.left)} s for its lease to expire (a supervisor gone with its "
        "host) or be renewed (a live one: this launch is then refused); Ctrl+C stops"
    )
    now: Optional[LockRecord] = held
    while not wait.expired and now == held:  # until renewed, released or taken by another
        wait.pause()
        now = directory.read_lock()
    try:
        return directory.acquire(lease)
    except RunBusy as busy:
        renewed = now is not None and now.token == held.token and now.renewed_at > held.renewed_at
        if not renewed:
            raise
        raise RunBusy(f"{busy}; it renewed its lease while this launch waited: it is alive") from None
