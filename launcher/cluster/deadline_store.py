"""Calls to a store on another machine, each with a deadline. torch's TCPStore client waits for
an answer with no end when the server's process is stopped (SIGSTOP, a frozen VM) though its
socket still accepts: a follower would freeze with it, deaf to signals and to its own node
timeout. Each call runs on one helper thread; the caller waits at most ``timeout`` seconds and
then gives the store up (the helper stays stuck with it, and the follower connects anew)."""

import concurrent.futures
import threading

__all__ = ["DeadlineStore", "StoreTimeout"]


class StoreTimeout(Exception):
    """The store did not answer within the deadline."""


class DeadlineStore:
    def __init__(self, store, timeout: float) -> None:
        self._store = store
        self._timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ftlaunch-store")
        self._stuck = threading.Event()

    def __getattr__(self, method: str):
        call = getattr(self._store, method)

        def with_deadline(*args):
            if self._stuck.is_set():
                raise StoreTimeout("an earlier call never returned")
            future = self._pool.submit(call, *args)
            try:
                return future.result(self._timeout)
            except concurrent.futures.TimeoutError:
                self._stuck.set()
                raise StoreTimeout(f"no answer within {self._timeout:g} s") from None

        return with_deadline

    def close(self) -> None:
        self._pool.shutdown(wait=False)
