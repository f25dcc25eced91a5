"""A follower whose --rdzv-endpoint is held by something that is not node 0's store: a program
that accepts connections and never answers (or answers half a word), as a stopped node 0 does.
torch's client waits for its first answer with no end; on the main thread that made the follower
deaf to SIGTERM (a kill -9 was the only way out). And a store that stops answering while the
nodes meet (node 0 stopped) held a SIGTERM for --node-timeout. A signal now ends it within the
grace period."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import ACTOR, SCRIPTS, until
from test_many_nodes import Job, free_port

# The follower never starts a worker: how workers start is not the subject.
pytestmark = pytest.mark.exec_workers

GRACE_S = 5.0  # --grace-period's default: a first signal ends the launch within it
# Within the grace period on a quiet machine (2.1 s measured); with both cores busy, a margin. Before
# the fixes: never, 17.7 s and 33.1 s.
ENDED_S = 3 * GRACE_S
WAITER = str(SCRIPTS / "waiter.py")

# Accepts, reads what a client sends, says "asked" once something came, and answers
# nothing ("silent") or two bytes of a four-byte word ("short").
_SERVER = """
import socket, sys
kind, port = sys.argv[1], int(sys.argv[2])
listener = socket.create_server(("127.0.0.1", port))
print("up", flush=True)
held = []
while True:
    conn, _ = listener.accept()
    held.append(conn)
    if conn.recv(64):
        print("asked", flush=True)
        if kind == "short":
            conn.sendall(b"\\x07\\x00")
"""


# A store as node 0's, without node 0: says "joining" once a node wrote its state into the
# rendezvous RDZV_ID (it waits in a round then, looking at the lobby's keys every half second).
_STORE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
port, key = int(sys.argv[1]), "torch.rendezvous." + sys.argv[2]
store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
print("up", flush=True)
while not store.check([key]) or store.get(key) == b"Y2FuaW1hZGFt":  # torch's empty state
    time.sleep(0.05)
print("joining", flush=True)
while True:
    time.sleep(60)
"""


class MuteServer:
    """One of the servers above on a free port of 127.0.0.1, stopped by PID."""

    def __init__(self, kind: str, *args: str) -> None:
        self.port = free_port()
        code = [_STORE, str(self.port), *args] if kind == "store" else [_SERVER, kind, str(self.port)]
        self.proc = subprocess.Popen([sys.executable, "-c", *code], stdout=subprocess.PIPE, text=True)
        self.expect("up")

    def expect(self, word: str) -> None:
        """Until the server prints ``word`` (its stdout ends with the server: bounded by it)."""
        line = self.proc.stdout.readline()
        assert line.strip() == word, f"server said {line!r}, not {word!r}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def mute_server(request):
    server = MuteServer(request.param)
    yield server
    server.stop()


@pytest.mark.parametrize(
    "mute_server, moment",
    [("silent", "asked"), ("silent", "said"), ("short", "asked")],
    indirect=["mute_server"],
)
def test_a_follower_at_an_endpoint_that_never_answers_ends_on_sigterm(launcher, mute_server, moment):
    follower = launcher.start(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{mute_server.port}", ACTOR
    )
    if moment == "asked":  # torch's client has sent its first request and waits for the answer
        mute_server.expect("asked")
    else:  # the follower says what it waits for
        line = follower.read_console_until(lambda text: "waiting for node 0" in text, 60, stream="stderr")
        assert "accepts connections but does not answer as a store" in line, line
    signalled = time.monotonic()
    follower.proc.send_signal(signal.SIGTERM)
    assert follower.wait(GRACE_S + 10) == 128 + signal.SIGTERM, follower.stderr
    assert time.monotonic() - signalled < ENDED_S, time.monotonic() - signalled
    assert "interrupted by SIGTERM while the nodes were meeting" in follower.stderr
    assert follower.survivors_after(10) == []


@pytest.mark.parametrize("mute_server", ["silent"], indirect=True)
def test_a_follower_at_an_endpoint_that_never_answers_says_so_at_its_join_timeout(launcher, mute_server):
    """Exit 5 at --join-timeout, saying node 0's port took the connection: not "nothing there"."""
    follower = launcher.start(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{mute_server.port}",
        "--join-timeout", "3s", ACTOR,
    )  # fmt: skip
    assert follower.wait(60) == 5, follower.stderr
    assert "accepts connections but did not answer as a store) within --join-timeout (3 s)" in follower.stderr
    assert follower.survivors_after(10) == []


def test_a_follower_whose_node_0_stops_answering_while_the_nodes_meet_ends_on_sigterm(launcher):
    """The lobby's calls have --node-timeout (60 s here) as their deadline; a signal ends one at
    once, and the stop passed on to node 0 waits a second at most."""
    node0 = MuteServer("store", "stray")
    try:
        follower = launcher.start(
            "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{node0.port}",
            "--rdzv-id", "stray", "--node-timeout", "60s", ACTOR,
        )  # fmt: skip
        node0.expect("joining")
        _sigterm_with_node_0_stopped(node0.proc.pid, follower, GRACE_S + 10)
        assert "interrupted by SIGTERM while the nodes were meeting" in follower.stderr
        assert follower.survivors_after(10) == []
    finally:
        node0.proc.send_signal(signal.SIGCONT)
        node0.stop()


def test_a_follower_whose_node_0_stops_during_an_attempt_ends_on_sigterm(launcher, tmp_path):
    """Node 0 stopped (SIGSTOP) while the ranks run: the follower's calls to its store had
    --node-timeout (30 s here) as their deadline, the stop's included, and its ranks ran on
    meanwhile. Once a signal came, a call waits STOPPING_S at most."""
    job = Job(
        launcher,
        tmp_path,
        2,
        "--nproc",
        "1",
        WAITER,
        "--go-file",
        str(tmp_path / "never"),
        node_timeout="30s",
    )
    node0, follower = job.start(0), job.start(1)
    follower.read_console_until(lambda line: "rank 1 attempt 0 waits" in line, 120)
    try:
        _sigterm_with_node_0_stopped(node0.proc.pid, follower, GRACE_S + 40)
        assert follower.survivors_after(10) == []
    finally:
        node0.proc.send_signal(signal.SIGCONT)
    node0.proc.send_signal(signal.SIGTERM)
    node0.wait(60)
    assert job.survivors() == []


def _sigterm_with_node_0_stopped(node0_pid: int, follower, wait_s: float) -> None:
    """SIGSTOP node 0, then SIGTERM the follower: it must end as signalled, within ENDED_S."""
    os.kill(node0_pid, signal.SIGSTOP)
    stopped = psutil.Process(node0_pid)
    until(lambda: stopped.status() == psutil.STATUS_STOPPED)
    signalled = time.monotonic()
    follower.proc.send_signal(signal.SIGTERM)
    assert follower.wait(wait_s) == 128 + signal.SIGTERM, follower.stderr
    assert time.monotonic() - signalled < ENDED_S, time.monotonic() - signalled
