"""DeadlineStore: a call to node 0's store that does not answer ends at its deadline, or within
STOPPING_S once a signal came (a follower whose node 0 stopped answered SIGTERM only once
--node-timeout had passed)."""

import signal
import threading
import time

import pytest

from launcher.cluster.deadline_store import STOPPING_S, DeadlineStore, StoreTimeout


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


def test_once_a_signal_came_a_call_node_0_does_not_answer_is_given_up_within_stopping_s():
    """A signal during the call (node 0 stopped while the nodes meet), or before it (the stop
    passed on): --node-timeout (30 s here) no longer holds the stop."""
    inbox = Inbox()
    store = Stopped(on_call=lambda: inbox.received.append(signal.SIGTERM))
    deadline_store = DeadlineStore(store, timeout=30, signals=inbox)
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        deadline_store.add("lobby/alive/x", 0)
    assert STOPPING_S <= time.monotonic() - started < STOPPING_S + 3 and deadline_store.stuck
    with pytest.raises(StoreTimeout, match="an earlier call never returned"):
        deadline_store.add("lobby/stopped", 0)
    store.release.set()
    deadline_store.close()


def test_once_a_signal_came_node_0_that_answers_is_answered():
    store = Stopped()
    store.release.set()
    deadline_store = DeadlineStore(store, timeout=30, signals=Inbox(signal.SIGTERM))
    assert deadline_store.add("k", 0) == 1 and deadline_store.add("k", 0) == 2
    assert not deadline_store.stuck
    deadline_store.close()


def test_without_a_signal_a_call_waits_its_whole_deadline():
    store = Stopped()
    deadline_store = DeadlineStore(store, timeout=0.3, signals=Inbox())
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        deadline_store.add("k", 0)
    assert time.monotonic() - started >= 0.3
    store.release.set()
    deadline_store.close()
