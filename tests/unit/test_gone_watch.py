"""cluster.gone: node 0 learns at once that a follower's supervisor is gone, from the end of the one
connection each follower holds (the kernel closes it when the process ends). Real sockets on
loopback; the end of a process is its socket's close here (the kill -9 of a node's tree is
tests/test_standby.py's)."""

import socket
import time

import pytest
from helpers import until

from launcher.cluster.gone import GoneWatch, hold_open


@pytest.fixture
def watch():
    gone = GoneWatch("127.0.0.1")
    yield gone
    gone.close()


def test_a_held_connection_is_not_gone_and_its_end_is_seen_at_once(watch):
    held = hold_open(watch.address, "host:123:1")
    other = hold_open(watch.address, "host:456:2")
    assert held is not None and other is not None
    assert watch.gone("host:123:1") is None
    before = time.monotonic()
    held.close()
    ended = until(lambda: watch.gone("host:123:1"))
    assert before <= ended and watch.gone("host:456:2") is None  # the other one stays open
    other.close()


def test_a_supervisor_that_holds_it_anew_is_no_longer_gone(watch):
    """A follower that lost node 0 for a while lets go and holds on again with the same token."""
    first = hold_open(watch.address, "host:123:1")
    first.close()
    until(lambda: watch.gone("host:123:1"))
    again = hold_open(watch.address, "host:123:1")
    until(lambda: watch.gone("host:123:1") is None)
    again.close()


def test_a_connection_that_never_said_its_token_or_says_too_much_marks_nothing(watch):
    host, port = watch.address.rsplit(":", 1)
    mute = socket.create_connection((host, int(port)))
    mute.close()
    chatty = socket.create_connection((host, int(port)))
    chatty.sendall(b"x" * 10_000)
    chatty.close()
    last = hold_open(watch.address, "host:789:3")  # seen after the two: they were looked at first
    last.close()
    until(lambda: watch.gone("host:789:3"))
    assert watch._ended.keys() == {"host:789:3"}


def test_nothing_listening_is_no_connection_and_no_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        assert hold_open(f"127.0.0.1:{port}", "t") is None
    assert hold_open("not an address", "t") is None
