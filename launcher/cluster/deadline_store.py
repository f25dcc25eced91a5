"""Calls to a store on another machine, each with a deadline. torch's TCPStore client waits for
an answer with no end when the server's process is stopped (SIGSTOP, a frozen VM) though its
socket still accepts: a follower would freeze with it, deaf to signals and to its own node
timeout. Each call runs on one helper thread; the caller waits at most ``timeout`` seconds and
then gives the store up (the helper, a daemon, stays stuck with it; the follower connects anew)."""

import queue
import threading
from typing import Any

__all__ = ["DeadlineStore", "StoreTimeout"]


class StoreTimeout(Exception):
    """The store did not answer within the deadline."""


class DeadlineStore:
    def __init__(self, store, timeout: float) -> None:
        self._store = store
        self._timeout = timeout
        self._calls: queue.Queue = queue.Queue()
        self._stuck = False
        # A daemon: a thread pool's worker would be joined at exit, forever if it is stuck.
        self._thread = threading.Thread(target=self._serve, name="ftlaunch-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            call, args, answer = item
            try:
                answer.put((True, call(*args)))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                answer.put((False, err))

    def __getattr__(self, method: str):
        call = getattr(self._store, method)

        def with_deadline(*args: Any) -> Any:
            if self._stuck:
                raise StoreTimeout("an earlier call never returned")
            answer: queue.Queue = queue.Queue(1)
            self._calls.put((call, args, answer))
            try:
                ok, value = answer.get(timeout=self._timeout)
            except queue.Empty:
                self._stuck = True
                raise StoreTimeout(f"no answer within {self._timeout:g} s") from None
            if not ok:
                raise value
            return value

        return with_deadline

    def close(self) -> None:
        self._calls.put(None)
