"""The one way to wait (launcher/process/waiting.py), driven by a fake clock: a deadline that
holds, a signal that ends the wait only when it came during it, lines said on their cadence, and
the waits built on it (a lobby's look at an earlier holder, node 0's wait for a refused node,
the pause between attempts) each ended by its deadline and by a signal (issue 35, item 2)."""

import os
import signal
from typing import Dict, List

import pytest
from helpers import until

from launcher.cluster.lobby import _alive
from launcher.grammar.errors import SignalReceived
from launcher.process.signals import SignalInbox
from launcher.process.waiting import Wait


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeInbox:
    """A SignalInbox on the fake clock: ``wait`` moves the clock on, and a signal scheduled at
    a time arrives when the clock passes it (and cuts that wait short)."""

    def __init__(self, clock: FakeClock, signals_at: Dict[float, int] = None) -> None:
        self.clock, self.received, self.slept = clock, [], []
        self._pending = sorted((clock.now + t, s) for t, s in (signals_at or {}).items())

    def wait(self, timeout: float) -> None:
        self.slept.append(timeout)
        until = self.clock.now + timeout
        if self._pending and self._pending[0][0] <= until:
            at, signum = self._pending.pop(0)
            self.clock.now = max(self.clock.now, at)
            self.received.append(signum)
            return
        self.clock.now = until

    def name(self, index: int) -> str:
        return signal.Signals(self.received[index]).name


def _wait(limit: float, inbox: FakeInbox, **kwargs) -> Wait:
    return Wait(limit, inbox, clock=inbox.clock, **kwargs)


def test_a_wait_ends_at_its_deadline_and_never_sleeps_past_it():
    inbox = FakeInbox(FakeClock())
    wait = _wait(1.0, inbox, look=0.3)
    turns = 0
    while not wait.expired:
        wait.pause()
        turns += 1
    assert turns == 4 and inbox.slept[-1] == pytest.approx(0.1)  # 0.3 0.3 0.3 then what was left
    assert wait.waited == pytest.approx(1.0) and wait.left == 0.0


def test_a_signal_during_the_wait_ends_it_with_that_signal():
    inbox = FakeInbox(FakeClock(), {0.5: signal.SIGTERM})
    wait = _wait(10.0, inbox, look=0.2)
    with pytest.raises(SignalReceived) as raised:
        while not wait.expired:
            wait.pause()
    assert raised.value.signum == signal.SIGTERM and wait.waited == pytest.approx(0.5)


def test_a_signal_that_came_before_the_wait_does_not_end_it_unless_asked():
    clock = FakeClock()
    inbox = FakeInbox(clock)
    inbox.received.append(signal.SIGTERM)  # answered already (the attempt stopped for it)
    wait = _wait(1.0, inbox)
    while not wait.expired:
        wait.pause()  # no SignalReceived: it came before
    with pytest.raises(SignalReceived):  # since=0: every signal so far ends the wait
        _wait(1.0, inbox, since=0).pause()


def test_what_a_wait_says_comes_on_its_cadence_first_when_asked():
    inbox = FakeInbox(FakeClock())
    wait = _wait(100.0, inbox, look=1.0)
    said: List[float] = []
    looked: List[float] = []
    while not wait.expired:
        if wait.due(30.0, first=10.0):
            said.append(round(wait.waited))
        if wait.due(5.0, "look", first=0):
            looked.append(round(wait.waited))
        wait.pause()
    assert said == [10, 40, 70] and looked == list(range(0, 100, 5))


class CountingStore:
    """A store whose liveness counter moves at the times given (seconds into the wait)."""

    def __init__(self, clock: FakeClock, moves_at: List[float]) -> None:
        self.clock, self.start, self.moves_at = clock, clock.now, moves_at

    def add(self, key: str, amount: int) -> int:
        return sum(1 for t in self.moves_at if self.start + t <= self.clock.now)


@pytest.mark.parametrize("moves_at, alive", [([0.35], True), ([], False)])
def test_the_lobby_judges_an_earlier_holder_by_its_beats_within_three_of_them(moves_at, alive):
    clock = FakeClock()
    inbox = FakeInbox(clock)
    assert _alive(CountingStore(clock, moves_at), "elsewhere:1:2", inbox, every=0.2, clock=clock) is alive
    assert clock.now - 1000.0 <= 3 * 0.2 + 0.1 + 1e-9  # never past three beats (and one look)


def test_a_signal_ends_the_lobbys_look_at_an_earlier_holder():
    clock = FakeClock()
    inbox = FakeInbox(clock, {0.15: signal.SIGINT})
    with pytest.raises(SignalReceived):
        _alive(CountingStore(clock, []), "elsewhere:1:2", inbox, every=0.2, clock=clock)


def test_the_preemption_notice_is_taken_as_sigterm_and_called_by_its_own_name():
    """A real inbox, a real SIGUSR1 to this process: recorded as SIGTERM (the same stop, exit
    143), named SIGUSR1 in what is said, and a second copy of it is the same request."""
    with SignalInbox() as inbox:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's copy to the step and the batch script's
        os.kill(os.getpid(), signal.SIGINT)
        assert until(lambda: len(inbox.received) == 2, timeout=5)
        assert inbox.received == [signal.SIGTERM, signal.SIGINT]
        assert inbox.name_of(signal.SIGTERM) == "SIGUSR1 (the preemption notice)"
        assert inbox.name(1) == "SIGINT"
        with pytest.raises(SignalReceived) as raised:
            inbox.raise_if_received()
    assert raised.value.signum == signal.SIGTERM and raised.value.exit_code == 143
    assert str(raised.value) == "interrupted by SIGUSR1 (the preemption notice) before any worker started"
