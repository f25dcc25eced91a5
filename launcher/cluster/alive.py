"""A supervisor's liveness counter in node 0's store, bumped from a thread: a main loop busy
stopping workers or writing run.json for a few seconds must not look like a dead supervisor."""

import threading

__all__ = ["BEAT_EVERY_S", "AliveCounter"]

BEAT_EVERY_S = 0.5  # bumps; watchers look as often


class AliveCounter(threading.Thread):
    def __init__(self, store, key: str) -> None:
        super().__init__(name=f"ftlaunch-alive-{key}", daemon=True)
        self._store, self._key = store, key
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - node 0 gone: the main loop finds out and says so
                return
            self._done.wait(BEAT_EVERY_S)

    def stop(self) -> None:
        self._done.set()
