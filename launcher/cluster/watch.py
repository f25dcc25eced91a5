"""Push, not poll: a node learns that another raised the attempt's interrupt from a blocking wait
that node 0's store answers the moment the key is set, not from looking at the key on every turn
of its loop (20 requests a second per node, issue 37). A healthy job sends the store nothing but
one renewed wait every ``RENEW_S``."""

import threading
from datetime import timedelta
from typing import Callable, Optional

__all__ = ["KeyWatch", "RENEW_S"]

# A wait the store did not answer is asked again this often (and a stopped watch ends): a request
# per node to node 0's store each time (10 s before issue 48 item 8; a watch stops once its
# attempt's interrupt is set, which every attempt's end does).
RENEW_S = 60.0


class KeyWatch(threading.Thread):
    """Waits, on a connection of its own (a blocking wait holds the one it is on), until ``key``
    is set; then ``value`` holds what it was set to (read on the same connection: the loop
    need not ask the store again, one round trip and two thread switches less on each node of a
    busy machine), ``fired`` is true and ``wake()`` ends the loop's sleep at once. A wait that fails
    otherwise than by its timeout (the store gone) ends the watch: ``broken`` is true, and the
    caller goes back to looking for itself (its liveness checks say what happened)."""

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
