"""How long the held run waits on storage, and its looks at the checkpoint dir. Each wait has a
deadline, and a signal that comes during one ends it (Ctrl+C again: leave now); once one did,
every later wait is short: the user asked twice."""

import math
import threading
import time
from typing import Callable, Generic, Optional, TypeVar

from launcher.core.events import Say
from launcher.grammar.errors import SignalReceived
from launcher.process.waiting import Inbox, Wait
from launcher.runs.checkpoints import CheckpointDir, NewestCheckpoint, Uncommitted

__all__ = ["CheckpointLooks", "StorageTime", "StoppingTime"]

T = TypeVar("T")

_LOOK_S = 0.05  # a wait on storage looks for a signal this often
_SLOW_S = 5.0  # a listing that has not answered in this long is said (a signal may end the wait)
# Once a signal came, the run's end waits on storage this long in all (the checkpoints' listing,
# the record of its end, the lock's release): with --grace-period's 5 s, within the 30 s SLURM
# (KillWait) and Kubernetes (terminationGracePeriodSeconds) give by default before SIGKILL.
_STOPPING_S = 10.0
# Once a signal cut a wait on storage short, each later one gets this long: enough for a local
# disk to take the run's end, not for storage that hangs. Within _STOPPING_S, the record and the
# release are each kept this much of it.
HURRIED_S = 0.5


class StoppingTime:
    """Once a signal came, the run's end has ``total`` seconds on storage in all: one deadline,
    set at its first wait. Each wait keeps back what the later ones are kept, so that the last
    still ends by the deadline: a scheduler's SIGKILL comes at a fixed time, not after our waits."""

    def __init__(self, total: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._total = total
        self._clock = clock
        self._deadline: Optional[float] = None

    def limit(self, seconds: float, kept_back: float) -> float:
        """At most ``seconds``, ending ``kept_back`` before the deadline; in tenths (it is said),
        rounded down."""
        now = self._clock()
        if self._deadline is None:
            self._deadline = now + self._total
        left = math.floor((self._deadline - kept_back - now) * 10) / 10
        return max(0.0, min(seconds, left))


class StorageTime:
    """The time each wait on storage is given, from the signals received so far."""

    def __init__(self, signals: Inbox) -> None:
        self._signals = signals
        self.hurried = ""  # a signal that cut a wait on storage short: later ones are short
        self._stopping = StoppingTime(_STOPPING_S)  # storage's time once a signal came

    def limit(self, seconds: float, kept_back: float) -> float:
        """How long the next wait on storage may take: ``seconds``, less once a signal came
        (``kept_back``: what the run's end's later waits are kept of the stopping run's time)."""
        if self.hurried:
            return min(seconds, HURRIED_S)
        if not self._signals.received:
            return seconds
        return self._stopping.limit(seconds, kept_back)

    @staticmethod
    def why(limit: float, full: float) -> str:
        """Said after a limit shorter than its wait's own (``full``)."""
        return "" if limit >= full else ", a stopping run's limit"

    def cut_short(self) -> Callable[[], None]:
        """What a wait on storage calls at every look: SignalReceived once a new signal came."""
        return Wait(0, self._signals).check_signals

    def cut(self, stop: SignalReceived) -> str:
        self.hurried = f"not waited for after {stop.said_as}"
        return self.hurried

    @property
    def signalled(self) -> bool:
        return bool(self._signals.received)


class CheckpointLooks:
    """The checkpoint dir's newest step and the run's end's clean-up, each looked at on a thread
    of its own within --storage-timeout (``timeout``)."""

    def __init__(self, checkpoints: CheckpointDir, timeout: float, time_: StorageTime, say: Say) -> None:
        self.checkpoints = checkpoints
        self._timeout = timeout
        self._time = time_
        self._say = say
        self._listing: Optional[_Listing[NewestCheckpoint]] = None  # a look still under way

    def newest(self) -> NewestCheckpoint:
        """The checkpoint dir's newest step, if storage lists it within --storage-timeout. While a
        listing that did not return is still under way, the answer is unknown at once."""
        if self._listing is None or self._listing.done.is_set():
            self._listing = _Listing(self.checkpoints.newest)
        answer = self._listen(self._listing, "list the checkpoints")
        newest = answer or NewestCheckpoint(known=False, error=self._listing.error)
        if newest.error:
            self._say(f"cannot list the checkpoints ({newest.error}); progress unknown")
        return newest

    def remove_uncommitted(self) -> Uncommitted:
        """At the run's end: parts never committed go, when the checkpoint dir answers."""
        if self._listing is not None and not self._listing.done.is_set():
            return Uncommitted()  # it did not answer the last look
        removing = _Listing(self.checkpoints.remove_uncommitted)
        return self._listen(removing, "remove the parts never committed") or Uncommitted()

    def _listen(self, listing: "_Listing[T]", what: str) -> Optional[T]:
        """A look at the checkpoint dir's answer, within --storage-timeout; said once when storage
        is slow to answer, since a signal ends the wait."""
        full = self._timeout
        limit = self._time.limit(full, kept_back=2 * HURRIED_S)  # for the record and the release
        named = "--storage-timeout" if limit >= full else "a stopping run's limit"
        try:
            answer = listing.result(limit, self._time.cut_short(), self._slow(what, limit, named), named)
        except SignalReceived as stop:
            listing.error = self._time.cut(stop)
            return None
        if self._time.hurried and not listing.done.is_set():
            listing.error = self._time.hurried
        return answer

    def _slow(self, what: str, limit: float, named: str) -> Callable[[], None]:
        def say() -> None:
            which = "another signal (Ctrl+C again)" if self._time.signalled else "a signal"
            self._say(
                f"the checkpoint dir {self.checkpoints.url} has not answered for {_SLOW_S:g} s: "
                f"waiting up to {limit:g} s ({named}) to {what}; {which} stops the wait"
            )

        return say


def _nothing() -> None:
    pass


class _Listing(Generic[T]):
    """A look at the checkpoint dir on a thread of its own: storage that does not answer keeps
    the thread, never the supervisor's loop."""

    def __init__(self, look: Callable[[], T]) -> None:
        self.done = threading.Event()
        self._answer: Optional[T] = None
        self.error = ""
        threading.Thread(target=self._run, args=(look,), name="ftlaunch-listing", daemon=True).start()

    def _run(self, look: Callable[[], T]) -> None:
        try:
            self._answer = look()
        except Exception as err:  # a storage library's own exception: the look failed, nothing more
            self.error = f"{type(err).__name__}: {err}".splitlines()[0]
        finally:
            self.done.set()

    def result(
        self,
        timeout: float,
        watch: Callable[[], None] = _nothing,
        slow: Callable[[], None] = _nothing,
        named: str = "--storage-timeout",
    ) -> Optional[T]:
        """Its answer; None when it failed, or gave none within ``timeout`` seconds (``error``
        says which, and ``named`` what set them). ``watch`` is called at every look (what it
        raises ends the wait); ``slow`` once, when there is no answer after _SLOW_S."""
        deadline = time.monotonic() + timeout
        slow_at = time.monotonic() + _SLOW_S
        while not self.done.wait(max(0.0, min(deadline - time.monotonic(), _LOOK_S))):
            if time.monotonic() >= deadline:
                self.error = f"no answer within {timeout:g} s, {named}"
                return None
            if time.monotonic() >= slow_at:
                slow_at = float("inf")
                slow()
            watch()
        return self._answer
