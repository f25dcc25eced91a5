"""Faults ``--chaos`` asks a worker to inflict on itself (a raise, an endless sleep or steps made
slower in the training thread, a death mid-part or before the commit), requested through
``contract.SLOT_CHAOS``."""

import signal
import sys
import time
from typing import BinaryIO, Callable, Optional, Tuple

from worker_lib.core import contract as c

__all__ = ["ChaosError", "act", "receive", "slow_down", "take"]


class ChaosError(RuntimeError):
    """The exception ``--chaos raise`` injects."""


_pending: Optional[Tuple[int, int]] = None  # (point, action) waiting for its save point
_slow = 0.0  # slow: each step takes this many times as long from now on; 0: not slowed
_step_began = 0.0  # slow: when the step now under way began (the last beat, once slept)


def receive(word: int) -> None:
    """A new request: carried out now when it is for a beat, kept for its save point otherwise."""
    global _pending, _slow, _step_began
    point, action = (word >> 8) & 0xFF, word & 0xFF
    if action == c.CHAOS_SLOW:
        _slow, _step_began = (word >> c.CHAOS_FACTOR_SHIFT) / 100, time.monotonic()
        print(f"[worker_lib] --chaos: each step {_slow:g}× as long from now on", file=sys.stderr, flush=True)
    elif point == c.CHAOS_AT_BEAT:
        act(action, "at a heartbeat")
    else:
        _pending = (point, action)


def slow_down() -> None:
    """At each beat of a rank made slow: wait (factor - 1) times the step just ended. Once slow,
    the rank waits for no one in the collectives, so its step is its own work: the factor holds
    (the wait is counted from after the last one, never compounding)."""
    global _step_began
    if not _slow:
        return
    now = time.monotonic()
    time.sleep((_slow - 1) * (now - _step_began))
    _step_began = time.monotonic()


def take(point: int) -> Optional[int]:
    """The action of the request waiting for ``point`` (taken: it happens once), or None."""
    global _pending
    if _pending is None or _pending[0] != point:
        return None
    action, _pending = _pending[1], None
    return action


def act(action: int, where: str) -> None:
    what = {c.CHAOS_RAISE: "an exception", c.CHAOS_SLEEP: "sleeping for good"}.get(action)
    print(f"[worker_lib] --chaos: {what or signal.Signals(action).name} {where}", file=sys.stderr, flush=True)
    if action == c.CHAOS_RAISE:
        raise ChaosError(f"injected by ftlaunch --chaos ({where})")
    if action == c.CHAOS_SLEEP:
        while True:
            time.sleep(3600)
    signal.raise_signal(action)


def dying_half_way(fill: Callable[[BinaryIO], object], action: int) -> Callable[[BinaryIO], object]:
    """``fill`` that carries out ``action`` once, after its first chunk: the part is torn (a rank
    stopped and continued must not stop again at its next chunk)."""

    class Torn:
        def __init__(self, handle: BinaryIO) -> None:
            self._handle, self._written, self._acted = handle, 0, False

        def write(self, data) -> int:
            if self._written and not self._acted:
                self._handle.flush()
                self._acted = True
                act(action, "half-way through writing its checkpoint part")
            self._written += len(data)
            return self._handle.write(data)

        def __getattr__(self, name):
            return getattr(self._handle, name)

    # Torn passes everything but write() through to the handle: a BinaryIO in all but its class.
    return lambda handle: fill(Torn(handle))  # type: ignore[arg-type]
