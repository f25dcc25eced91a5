"""A supervisor's liveness counter in node 0's store, bumped from a thread: a main loop busy
stopping workers or writing run.json for a few seconds must not look like a dead supervisor."""

import threading
import time
from typing import Optional

__all__ = ["AliveCounter", "beat_every", "look_every"]
# A wake-up this much later than asked for means the whole process did not run meanwhile
# (SIGSTOP, a paused VM, swapping): every thread of it was silent.
_STALL_S = 2.0


def beat_every(node_timeout: float) -> float:
    """How often a supervisor bumps its counter: a fifth of the silence that makes it lost,
    within 0.25..3 s (beats are the bulk of node 0's store traffic)."""
    return min(max(node_timeout / 5, 0.25), 3.0)


def look_every(node_timeout: float) -> float:
    """How often node 0 reads every counter (one request): a tenth of the node timeout, within
    0.25..1.5 s."""
    return min(max(node_timeout / 10, 0.25), 1.5)


class AliveCounter(threading.Thread):
    """Also this process's witness: ``stalled`` is the longest time it did not run, ending at
    ``stalled_until`` (monotonic), so a node does not blame others for its own silence. No
    ``store``: the witness alone (node 0)."""

    def __init__(self, store, key: str, every: float) -> None:
        super().__init__(name=f"ftlaunch-alive-{key}", daemon=True)
        self._store, self._key, self.every = store, key, every
        self._done = threading.Event()
        self.stalled = 0.0
        self.stalled_until = 0.0
        self.bumped = time.monotonic()  # the last bump answered (or the start)
        self.asking: Optional[float] = None  # when the bump under way was sent (None: none is)

    @property
    def running_late(self) -> bool:
        """It has not bumped for a stall past its turn: this process may just have come back."""
        return time.monotonic() - self.bumped >= max(_STALL_S, self.every + 0.5)

    def run(self) -> None:
        turned = time.monotonic()  # one turn: a bump and a beat's sleep; a stall anywhere in it shows
        while not self._done.is_set():
            self.asking = time.monotonic()
            try:
                if self._store is not None:
                    self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - node 0 gone: the main loop finds out and says so
                return
            self.bumped, self.asking = time.monotonic(), None
            self._done.wait(self.every)
            now = time.monotonic()
            late, turned = now - turned - self.every, now
            if late >= _STALL_S:
                self.stalled, self.stalled_until = max(self.stalled, late), now

    def stop(self) -> None:
        self._done.set()
