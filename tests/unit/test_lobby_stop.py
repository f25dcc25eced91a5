"""A signal while the nodes meet stops every node: the stop notice in node 0's store (the lobby),
over an in-process store (torch's HashStore) and an inbox no signal reaches."""

import signal

import pytest
from torch.distributed import HashStore

from launcher.cluster.lobby import Lobby, StopNotice, read_stop, say_stop, stop_read
from launcher.process.waiting import Wait


class _Quiet:
    """A signal inbox that never gets one, on a clock the test moves."""

    received: list = []

    def __init__(self, clock):
        self._clock = clock

    def wait(self, seconds: float) -> None:
        self._clock.now += seconds

    def name(self, index: int) -> str:
        return ""


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store():
    store = HashStore()
    store.append("lobby/hellos", "1,2,")
    return store


def test_the_first_stop_stands_and_no_node_reads_its_own(store):
    say_stop(store, StopNotice(1, signal.SIGTERM, "SIGTERM"))
    say_stop(store, StopNotice(2, signal.SIGINT, "SIGINT"))  # at the same moment: one stop
    assert read_stop(store, 1) is None
    assert read_stop(store, 0) == read_stop(store, 2) == StopNotice(1, signal.SIGTERM, "SIGTERM")


def test_no_stop_is_none(store):
    assert read_stop(store, 0) is None and read_stop(store, 1) is None


def test_node_0_waits_for_every_follower_that_came_then_goes(store):
    clock, said = _Clock(), []
    say_stop(store, StopNotice(0, signal.SIGUSR1, "SIGUSR1"))
    stop_read(store, 1)
    stop_read(store, 2)
    wait = Wait(30, _Quiet(clock), clock=clock)
    Lobby(store, "job", ["python", "x.py"], 30).await_stop_read(wait, said.append)
    assert clock.now == 0 and said == []  # both had read it: no wait at all


def test_a_follower_that_never_reads_is_waited_out_and_named_once(store):
    clock, said = _Clock(), []
    say_stop(store, StopNotice(1, signal.SIGTERM, "SIGTERM"))  # the signalled node has read its own
    wait = Wait(30, _Quiet(clock), clock=clock)
    Lobby(store, "job", ["python", "x.py"], 30).await_stop_read(wait, said.append)
    assert wait.expired
    assert len(said) == 1 and "node(s) 2 to learn of it" in said[0]
