"""A follower whose --rdzv-endpoint is held by something that is not node 0's store: a program
that accepts connections and never answers (or answers half a word), as a stopped node 0 does.
torch's client waits for its first answer with no end; on the main thread that made the follower
deaf to SIGTERM (a kill -9 was the only way out). A signal now ends it within the grace period."""

import signal
import subprocess
import sys
import time

import pytest
from helpers import ACTOR
from test_many_nodes import free_port

# The follower never starts a worker: how workers start is not the subject.
pytestmark = pytest.mark.exec_workers

GRACE_S = 5.0  # --grace-period's default: a first signal ends the launch within it

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


class MuteServer:
    """The server above on a free port of 127.0.0.1, stopped by PID."""

    def __init__(self, kind: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, kind, str(self.port)], stdout=subprocess.PIPE, text=True
        )
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
    assert time.monotonic() - signalled < GRACE_S, time.monotonic() - signalled
    assert "interrupted by SIGTERM while the nodes were meeting" in follower.stderr
    assert follower.survivors_after(10) == []
