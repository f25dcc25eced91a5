"""Calls to a store on another machine, each with a deadline. torch's TCPStore client waits for
an answer with no end when the server's process is stopped (SIGSTOP, a frozen VM) though its
socket still accepts: a follower would freeze with it, deaf to signals and to its own node
timeout. Each call runs on one helper thread; the caller waits at most ``timeout`` seconds and
then gives the store up (the helper, a daemon, stays stuck with it; the follower connects anew).
Given the signal inbox, a signal that comes during a call ends the wait for it at once
(SignalReceived); the next call is answered after that one, within its own deadline."""

import queue
import threading
from typing import Any, Optional

from launcher.process.waiting import Inbox, Wait

__all__ = ["DeadlineStore", "StoreTimeout"]

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

    def __getattr__(self, method: str):
        return lambda *args: self.call(method, *args)

    def call(self, method: str, *args: Any, limit: Optional[float] = None) -> Any:
        """``store.method(*args)`` within ``limit`` seconds (default: the store's timeout);
        StoreTimeout past it, SignalReceived for a signal that came during the call."""
        if self._stuck:
            raise StoreTimeout("an earlier call never returned")
        limit = self._timeout if limit is None else min(limit, self._timeout)
        answer: queue.Queue = queue.Queue(1)
        self._calls.put((getattr(self._store, method), args, answer))
        ok, value = self._answer(answer, limit)
        if not ok:
            raise value
        return value

    def _answer(self, answer: queue.Queue, limit: float) -> Any:
        wait = Wait(limit, self._signals) if self._signals is not None else None
        try:
            if wait is None:
                return answer.get(timeout=limit)
            while True:
                try:
                    return answer.get(timeout=min(_LOOK_S, max(wait.left, 0.001)))
                except queue.Empty:
                    wait.check_signals()
                    if wait.expired:
                        raise
        except queue.Empty:
            self._stuck = True
            raise StoreTimeout(f"no answer within {limit:g} s") from None

    @property
    def stuck(self) -> bool:
        """A call never returned: node 0 does not answer."""
        return self._stuck

    def within(self, limit: float) -> "_Within":
        """This store, each call within ``limit`` seconds (a stop's best-effort word)."""
        return _Within(self, limit)

    def close(self) -> None:
        self._calls.put(None)


class _Within:
    def __init__(self, store: DeadlineStore, limit: float) -> None:
        self._store, self._limit = store, limit

    def __getattr__(self, method: str):
        return lambda *args: self._store.call(method, *args, limit=self._limit)
