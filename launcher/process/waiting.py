"""The one way the launcher waits on other nodes, stores and processes: a deadline, the signal
inbox (a signal that comes during the wait ends it, one that came before does not), a look every
so often, and a line said every so many seconds. Each wait keeps its own loop (what it looks at
differs), and asks this object everything else, so that none can forget its deadline or a signal.
The clock is passed in: the unit tests drive a wait with a fake clock and a fake inbox."""

import time
from typing import Callable, Dict, List, Optional, Protocol

from launcher.grammar.errors import SignalReceived

__all__ = ["Inbox", "Wait"]

LOOK_S = 0.05  # how often a wait looks again, unless it says otherwise


class Inbox(Protocol):
    """What a wait needs of the SignalInbox: the signals so far, a sleep they cut short, and
    what to call one."""

    @property
    def received(self) -> List[int]: ...

    def wait(self, timeout: float) -> None: ...

    def name(self, index: int) -> str: ...


class Wait:
    """``limit`` seconds from now. ``since``: how many of the inbox's signals came before the
    wait (only later ones end it; default: all so far). ``look``: seconds between looks."""

    def __init__(
        self,
        limit: float,
        signals: Inbox,
        *,
        since: Optional[int] = None,
        look: float = LOOK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._signals = signals
        self._since = len(signals.received) if since is None else since
        self._look = look
        self._clock = clock
        self.started = clock()
        self.deadline = self.started + limit
        self._said_at: Dict[str, float] = {}  # what ``due`` names → when it is due next

    @property
    def expired(self) -> bool:
        return self._clock() >= self.deadline

    @property
    def waited(self) -> float:
        """Seconds since the wait began."""
        return self._clock() - self.started

    @property
    def left(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def pause(self) -> None:
        """Until the next look (never past the deadline); SignalReceived when a signal came
        during the wait."""
        self._signals.wait(min(self._look, self.left))
        self.check_signals()

    def check_signals(self) -> None:
        """SignalReceived (the first signal of the wait) once one has come."""
        received = self._signals.received
        if len(received) > self._since:
            raise SignalReceived(received[self._since], self._signals.name(self._since))

    def due(self, every: float, name: str = "say", first: Optional[float] = None) -> bool:
        """True once each ``every`` seconds of the wait, for what it does now and then (``name``
        tells such things apart): say that it still waits, look for a job that ended. The first
        time is ``first`` seconds in (default: ``every``)."""
        now = self._clock()
        at = self._said_at.get(name, self.started + (every if first is None else first))
        if now < at:
            return False
        self._said_at[name] = now + every
        return True
