"""DeadlineStore: a call to node 0's store that does not answer ends at its deadline, or at once
for a signal that comes during it (a follower whose node 0 stopped answered SIGTERM only once
--node-timeout had passed)."""

import signal
import threading
import time

import pytest

from launcher.cluster.deadline_store import DeadlineStore, StoreTimeout
from launcher.grammar.errors import SignalReceived


class Inbox:
    """The signal inbox as a wait reads it."""

    def __init__(self, *received: int) -> None:
        self.received = list(received)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def name(self, index: int) -> str:
        return signal.Signals(self.received[index]).name


class Stopped:
    """A store whose first ``add`` waits until released; ``on_call`` runs as that call begins."""

    def __init__(self, on_call=lambda: None) -> None:
        self.release, self._on_call, self.calls = threading.Event(), on_call, 0

    def add(self, key: str, value: int) -> int:
        self.calls += 1
        if self.calls == 1:
            self._on_call()
            self.release.wait(30)
        return self.calls


def test_a_signal_during_a_call_ends_the_wait_at_once_and_the_next_call_is_answered_after_it():
    inbox = Inbox()
    store = Stopped(on_call=lambda: inbox.received.append(signal.SIGTERM))
    deadline_store = DeadlineStore(store, timeout=30, signals=inbox)
    started = time.monotonic()
    with pytest.raises(SignalReceived) as stopped:
        deadline_store.add("lobby/alive/x", 0)
    assert stopped.value.signum == signal.SIGTERM and time.monotonic() - started < 5
    store.release.set()  # node 0 goes on: the store is not given up
    assert deadline_store.add("lobby/alive/x", 0) == 2 and not deadline_store.stuck
    deadline_store.close()


def test_a_signal_that_came_before_the_call_does_not_end_it():
    store = Stopped()
    store.release.set()
    deadline_store = DeadlineStore(store, timeout=30, signals=Inbox(signal.SIGTERM))
    assert deadline_store.add("k", 0) == 1
    deadline_store.close()


def test_a_call_within_a_shorter_limit_gives_the_store_up_past_it():
    """A stop passed on to a stopped node 0 is a word, not a wait of --node-timeout."""
    store = Stopped()
    deadline_store = DeadlineStore(store, timeout=30, signals=Inbox())
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        deadline_store.within(0.2).add("lobby/stopped", 0)
    assert time.monotonic() - started < 5 and deadline_store.stuck
    with pytest.raises(StoreTimeout, match="an earlier call never returned"):
        deadline_store.add("k", 0)
    store.release.set()
    deadline_store.close()
