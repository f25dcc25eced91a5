"""Calls to a store on another machine, each with a deadline: torch's TCPStore client waits with no
end on a stopped server whose socket still accepts. Each call runs on a helper thread, waited for
``timeout`` seconds at most, or ``STOPPING_S`` once a signal has come (a stop must not wait
--node-timeout for a node 0 that does not answer)."""

import queue
import threading
from typing import Any, Optional

from launcher.process.waiting import Inbox, Wait

__all__ = ["STOPPING_S", "DeadlineStore", "StoreTimeout"]

STOPPING_S = 2.0
_LOOK_S = 0.05  # how often a caller waiting for an answer looks at the signals


class StoreTimeout(Exception):
    """The store did not answer within the deadline."""


class DeadlineStore:
    def __init__(self, store, timeout: float, signals: Optional[Inbox] = None) -> None:
        self._store = store
        self._timeout = timeout
        self._signals = signals
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

    @property
    def stuck(self) -> bool:
        """A call never returned: the store does not answer."""
        return self._stuck

    def __getattr__(self, method: str):
        call = getattr(self._store, method)

        def with_deadline(*args: Any) -> Any:
            if self._stuck:
                raise StoreTimeout("an earlier call never returned")
            answer: queue.Queue = queue.Queue(1)
            self._calls.put((call, args, answer))
            ok, value = self._answer(answer)
            if not ok:
                raise value
            return value

        return with_deadline

    def _answer(self, answer: queue.Queue) -> Any:
        if self._signals is None:
            try:
                return answer.get(timeout=self._timeout)
            except queue.Empty:
                return self._given_up(self._timeout)
        wait, stopping = Wait(self._timeout, self._signals, since=0), None
        while True:
            if stopping is None and self._signals.received:
                stopping = Wait(STOPPING_S, self._signals, since=0)
            if wait.expired or (stopping is not None and stopping.expired):
                return self._given_up(min(wait.waited, self._timeout))  # the limit, not a late look
            try:
                return answer.get(timeout=min(_LOOK_S, wait.left))
            except queue.Empty:
                pass

    def _given_up(self, waited: float) -> Any:
        self._stuck = True
        raise StoreTimeout(f"no answer within {waited:.3g} s")

    def close(self) -> None:
        self._calls.put(None)
