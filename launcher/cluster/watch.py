"""Push, not poll: a node learns of the attempt's interrupt from a blocking wait that node 0's store
answers when the key is set (polling cost 20 requests a second per node, issue 37)."""

import threading
from datetime import timedelta
from typing import Callable, Optional

__all__ = ["KeyWatch", "RENEW_S"]

# A wait the store did not answer is renewed this often (a request per node each time).
RENEW_S = 60.0


class KeyWatch(threading.Thread):
    """Waits on a connection of its own until ``key`` is set: then ``value`` holds it, ``fired``
    is true and ``wake()`` ends the loop's sleep. A wait failing otherwise than by its timeout
    sets ``broken``: the caller looks for itself."""

    def __init__(self, store, key: str, wake: Callable[[], None]) -> None:
        super().__init__(name=f"ftlaunch-watch-{key}", daemon=True)
        self._store, self._key, self._wake = store, key, wake
        self._done = threading.Event()
        self.fired = False
        self.broken = False
        self.value: Optional[str] = None  # once fired; None where it could not be read

    def run(self) -> None:
        try:
            store = self._store.clone()
        except Exception:  # noqa: BLE001 - no second connection: the caller looks for itself
            self.broken = True
            return
        while not self._done.is_set():
            try:
                store.wait([self._key], timedelta(seconds=RENEW_S))
            except Exception as err:  # noqa: BLE001 - torch's DistError family, by any name
                if "timeout" in str(err).lower() or "timed out" in str(err).lower():
                    continue
                self.broken = True
                return
            try:
                self.value = store.get(self._key).decode()
            except Exception:  # noqa: BLE001 - the loop reads it itself
                self.value = None
            self.fired = True
            self._wake()
            return

    def stop(self) -> None:
        """Ends with its current wait (within ``RENEW_S``): a daemon, never joined."""
        self._done.set()
