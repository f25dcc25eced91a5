"""Which errors of a call to node 0's store mean node 0 is gone: the errors a real store raises
once its server is gone (an in-process TCPStore server, closed), and the ones that stay defects."""

import gc
from datetime import timedelta

import pytest
from torch.distributed import DistError, DistStoreError, TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from launcher.cluster.channel import ChannelSpec
from launcher.cluster.deadline_store import StoreTimeout
from launcher.cluster.follower_channel import FollowerChannel
from launcher.cluster.rendezvous import LeaderUnreachable
from launcher.cluster.store_errors import leader_gone, what_failed
from launcher.cluster.wire import NodeInfo
from launcher.grammar.errors import UsageError


class _Inbox:
    """The signal inbox as a channel uses it: none received."""

    received: list = []
    answered = 0

    def wait(self, seconds: float) -> None:
        pass

    def wake(self) -> None:
        pass


def _node_0() -> list:
    """Node 0's store, held only in the list: ``_dies`` empties it."""
    return [TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)]


def _dies(node_0: list) -> None:
    """Node 0 dies: its store's server and every connection to it close."""
    node_0.clear()
    gc.collect()


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


def test_every_error_of_a_store_whose_server_died_means_node_0_is_gone():
    server = _node_0()
    port = server[0].port
    client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=2))
    client.set("k", "v")
    _dies(server)
    reset = _raised(lambda: C10dRendezvousBackend(client, "job"))  # the defect's window, in _join
    assert isinstance(reset, RendezvousConnectionError) and leader_gone(reset)
    assert "DistNetworkError" in what_failed(reset)  # the store's own error, not c10d's wrapper
    errors = [_raised(lambda: client.compare_set("x", "", "y")), _raised(lambda: client.add("a", 1))]
    errors.append(_raised(lambda: TCPStore("127.0.0.1", port, None, False, timedelta(seconds=0.3))))
    assert all(isinstance(err, DistError) and leader_gone(err) for err in errors), errors


@pytest.mark.parametrize(
    "err",
    [
        StoreTimeout("no answer within 3 s"),
        ConnectionResetError(104, "Connection reset by peer"),
        BrokenPipeError(32, "Broken pipe"),
        ConnectionRefusedError(111, "Connection refused"),
        TimeoutError("timed out"),
        DistStoreError("wait timeout after 15000ms"),
        RuntimeError("Connection reset by peer"),  # a torch without a type of its own for it
        RuntimeError("Broken pipe"),
        RuntimeError("connect() to 10.0.0.1:29400 failed: Connection refused"),
        RuntimeError("Socket Timeout"),
    ],
    ids=repr,
)
def test_a_dead_or_silent_stores_errors_mean_node_0_is_gone(err):
    assert leader_gone(err)


@pytest.mark.parametrize(
    "err",
    [
        ValueError("The run id must be a non-empty string."),
        TypeError("compare_set(): incompatible function arguments"),
        KeyError("plan"),
        RuntimeError("dictionary changed size during iteration"),
        UsageError("--rdzv-conf: bad"),
    ],
    ids=repr,
)
def test_a_defect_is_not_taken_for_a_lost_node_0(err):
    assert not leader_gone(err)


def test_a_followers_channel_loses_a_dead_node_0_and_raises_a_defect_as_it_is():
    """The attempt's channel takes the same errors, and only those, for node 0 lost."""
    server = _node_0()
    client = TCPStore("127.0.0.1", server[0].port, None, False, timedelta(seconds=2))
    channel = FollowerChannel(client, ChannelSpec(1, 2, 2.0, "127.0.0.1:0"), _Inbox())
    try:
        with pytest.raises(TypeError):  # a call that no store accepts is ftlaunch's own defect
            channel._call("compare_set", "interrupt")
        assert not channel.broken
        _dies(server)
        with pytest.raises(LeaderUnreachable, match="DistNetworkError"):
            channel.announce(NodeInfo(1, "host", 101, 1, ["train.py"]))
        assert "is gone" in channel.broken
    finally:
        channel.close()
