"""The lobby's claims and hellos over an in-process store: who may hold a node rank, and which
node came for another job."""

import socket
import time

import pytest
from helpers import dead_pid
from torch.distributed import HashStore

from launcher.cluster.alive import AliveCounter
from launcher.cluster.lobby import Hello, Lobby, NodeClaim, read_unhealthy, say_unhealthy
from launcher.core.owned import pid_space
from launcher.grammar.errors import UsageError


class Quiet:
    """A signal inbox that no signal reaches: its waits sleep for real."""

    received: list = []

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)


QUIET = Quiet()


def _claim(node=1, rdzv_id="job", command=("script", "train.py")):
    return NodeClaim(node, Hello(node, "here", 1, rdzv_id, list(command)), node_timeout=5.0)


def test_a_live_holder_keeps_its_node_rank():
    store = HashStore()
    first, second = _claim(), _claim()
    first.take(store, store, QUIET)
    with pytest.raises(UsageError, match="already held .* which is alive"):
        second.take(store, store, QUIET)
    first.take(store, store, QUIET)  # its own claim again (a reconnect): still its own
    first.release()


def test_the_rank_of_a_dead_supervisor_is_taken_over_at_once():
    store = HashStore()
    store.set("lobby/claim/1", f"{pid_space()}:{dead_pid()}:1")
    started = time.monotonic()
    claim = _claim()
    claim.take(store, store, QUIET)
    assert time.monotonic() - started < 1.0  # the kernel says it is gone: no beats to watch
    assert store.get("lobby/claim/1").decode() == claim.token
    claim.release()


def test_a_live_holder_in_another_pid_namespace_of_this_host_keeps_its_node_rank():
    """Its pid is another namespace's (a container's): missing here, which proves nothing. Its
    beats tell (was: taken over at once, as if the kernel had said it was gone)."""
    store = HashStore()
    token = f"{socket.gethostname()}/pidns-1:{dead_pid()}:1"
    store.set("lobby/claim/1", token)
    beats = AliveCounter(store, f"lobby/alive/{token}", every=0.1)
    beats.start()
    try:
        with pytest.raises(UsageError, match="already held .* which is alive"):
            _claim().take(store, store, QUIET)
    finally:
        beats.stop()
        beats.join(5)
    assert store.get("lobby/claim/1").decode() == token


def test_a_holder_that_stopped_beating_on_another_host_is_taken_over():
    store = HashStore()
    store.set("lobby/claim/1", "elsewhere:12345:1")
    claim = _claim()
    claim.take(store, store, QUIET)  # watched for three of its beats first
    assert store.get("lobby/claim/1").decode() == claim.token
    claim.release()


def test_node_0_refuses_a_node_that_came_for_another_job():
    store = HashStore()
    stranger, friend = _claim(1, "other-job", ("script", "train.py", "--lr", "2")), _claim(2)
    stranger.take(store, store, QUIET)
    friend.take(store, store, QUIET)
    lobby = Lobby(store, "job", ("script", "train.py"), node_timeout=5)
    (hello,) = lobby.strangers()
    assert hello.node == 1
    assert stranger.refusal(store) == ""
    store.set("lobby/read/1", "1")  # as the refused node does when it reads the refusal
    reason = lobby.refuse(hello, QUIET)
    assert "runs another command than node 0: train.py --lr 2" in reason
    assert stranger.refusal(store) == reason and friend.refusal(store) == ""
    assert lobby.strangers() == []  # refused once
    stranger.release(), friend.release()


def test_followers_that_left_unhealthy_are_read_back_in_order_each_on_one_line():
    store = HashStore()
    assert read_unhealthy(store) == []
    say_unhealthy(store, 2, "node 2 is unhealthy: --health-check failed: exit 1; last output: a | b")
    say_unhealthy(store, 1, "node 1 is unhealthy: gpu 0 failed: CUDA error:\nan illegal memory access")
    assert read_unhealthy(store) == [
        (2, "node 2 is unhealthy: --health-check failed: exit 1; last output: a | b"),
        (1, "node 1 is unhealthy: gpu 0 failed: CUDA error: an illegal memory access"),
    ]
