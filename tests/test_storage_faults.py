"""Storage fails under a live supervisor: the run dir's dies for good, stops answering, or comes
back after a while; /dev/shm is full. Real GCS emulators (one per test, stopped and restarted by PID) through
gcsfs, real workers. The supervisor's loop never waits on storage: a signal is answered at once
whatever storage does, a blip shorter than the lease does not end the run, and storage silent for
longer than the lease ends it with its own exit code and one line. What gcsfs's gRPC look-ups
print against an emulator stays off the console (the last tests)."""

import contextlib
import os
import re
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, List

import pytest
from conftest import use_emulator
from helpers import SCRIPTS, read_logged, run_state
from storage_servers import start_gcs

from launcher.core.events import Transition
from launcher.core.group_state import GroupState
from launcher.grammar.errors import ExitCode
from launcher.runs.directory import RunDir

# Storage's own retries last minutes; the tests wait out a few. The storage is the subject, not
# how the workers start.
pytestmark = [pytest.mark.timeout(300), pytest.mark.exec_workers]

WAITER = str(SCRIPTS / "waiter.py")


class Emulator:
    """A GCS emulator of this test's own, which keeps its objects across a restart on its port."""

    def __init__(self, folder: Path, monkeypatch) -> None:
        import fsspec

        self.folder = folder
        self.server, self.env = start_gcs(folder, keep_data=True)
        self.port = int(self.env["FSSPEC_GCS_ENDPOINT_URL"].rsplit(":", 1)[1])
        use_emulator("gcs", self.env, monkeypatch)
        self.bucket = f"test-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("gcs").mkdir(self.bucket)
        self.alive = True

    def kill(self) -> None:
        self.server.stop()
        self.alive = False

    def restart(self) -> None:
        self.server, _ = start_gcs(self.folder, port=self.port, keep_data=True)
        self.alive = True


class BlackHole:
    """Storage that hangs: a server on the emulator's port that takes every connection and
    never answers. ``accepted`` counts the connections made to it."""

    def __init__(self, port: int) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(64)
        self._held: List[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def accepted(self) -> int:
        return len(self._held)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self._held.append(conn)

    def close(self) -> None:
        self._sock.close()
        self._thread.join(5)
        for conn in self._held:
            conn.close()


@pytest.fixture
def emulator(tmp_path, monkeypatch):
    folder = tmp_path / "gcs"
    folder.mkdir()
    emulator = Emulator(folder, monkeypatch)
    yield emulator
    if emulator.alive:
        emulator.kill()


def _start(launcher, emulator: Emulator, tmp_path: Path, *options: str, checkpoints: str = ""):
    """A waiting rank, the run dir on the emulator, the checkpoint dir local unless given."""
    launch = launcher.start(
        "--nproc", "1", "--run-dir", f"gs://{emulator.bucket}/runs", "--run-name", "deaf",
        "--checkpoint-dir", checkpoints or str(tmp_path / "ckpt"), *options,
        WAITER, "--go-file", str(tmp_path / "go"), env=emulator.env,
    )  # fmt: skip
    launch.read_console_until(lambda line: "waits for" in line, timeout=120)
    # The run dir is written by a thread of its own: the worker may be up before run.json is in
    # storage. The faults start once storage holds the running attempt, as a relaunch needs it.
    _bounded(lambda: _running_attempt_recorded(f"gs://{emulator.bucket}/runs/deaf"), timeout=60)
    return launch


def _running_attempt_recorded(where: str) -> bool:
    state = RunDir(where).read_state()
    return state is not None and bool(state.attempts) and state.attempts[-1].outcome is None


def _bounded(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


@contextlib.contextmanager
def _hanging(emulator: Emulator) -> Iterator[BlackHole]:
    """The emulator gone and its port taken by storage that never answers, until the block ends."""
    emulator.kill()
    hole = BlackHole(emulator.port)
    try:
        yield hole
    finally:
        hole.close()


@pytest.mark.parametrize("event", ["SIGTERM", "a worker's exit"])
def test_a_signal_or_an_exit_is_answered_at_once_while_the_run_dir_storage_hangs(
    launcher, emulator, tmp_path, event
):
    launch = _start(launcher, emulator, tmp_path)
    with _hanging(emulator) as hole:
        _bounded(lambda: hole.accepted > 0, timeout=60)  # the supervisor's next look waits on it now
        happened = time.monotonic()
        if event == "SIGTERM":
            launch.proc.send_signal(signal.SIGTERM)
        else:
            (tmp_path / "go").touch()
        expected = ExitCode.PREEMPTED if event == "SIGTERM" else ExitCode.SUCCESS
        assert launch.wait(120) == expected, launch.stderr
    answered = GroupState.STOPPING if event == "SIGTERM" else GroupState.SUCCEEDED
    seen = [
        found.t_mono
        for found in read_logged(launch.log_dir / "events.jsonl")
        if isinstance(found.event, Transition) and found.event.new is answered
    ]
    # A call to storage that hangs lasts minutes: the answer must not wait behind one.
    assert seen and seen[0] - happened < 5.0, (seen, happened)
    assert "Traceback" not in launch.stderr and "internal error" not in launch.stderr
    assert "the run's end is not recorded" in launch.stderr
    assert launch.survivors() == []


def test_a_second_signal_ends_the_waits_on_storage_that_does_not_answer_at_the_runs_end(
    launcher, emulator, tmp_path
):
    """Ctrl+C twice: the run dir and the checkpoint dir both hang. The first SIGTERM stops the
    ranks; the run's end then waits on storage (the checkpoints' listing up to --storage-timeout,
    then the run's record): the second ends every such wait at once, and each says so. Before, a
    SIGTERM with storage gone took about 30 s, the most SLURM and Kubernetes wait before SIGKILL."""
    launch = _start(
        launcher, emulator, tmp_path, "--storage-timeout", "10m", checkpoints=f"gs://{emulator.bucket}/ckpt"
    )
    with _hanging(emulator):
        launch.proc.send_signal(signal.SIGTERM)
        slow = "has not answered for 5 s"
        launch.read_console_until(lambda line: slow in line, timeout=120, stream="stderr")
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait(60) == ExitCode.PREEMPTED, launch.stderr
    assert "cannot list the checkpoints (not waited for after SIGTERM); progress unknown" in launch.stderr
    assert "the run's end is not recorded" in launch.stderr
    assert "(not waited for after SIGTERM)" in launch.stderr.split("the run's end is not recorded")[1]
    assert "Traceback" not in launch.stderr and "internal error" not in launch.stderr
    assert launch.survivors() == []


def test_one_signal_ends_the_run_within_a_schedulers_grace_while_storage_does_not_answer(
    launcher, emulator, tmp_path
):
    """One SIGTERM (a scheduler's, with SIGKILL 30 s later), the run dir and the checkpoint dir
    both hanging, --storage-timeout 10 minutes: the run's end waits on storage 10 s in all, not
    --storage-timeout and 5 s and 5 s more. Before, the listing alone waited the 10 minutes."""
    launch = _start(
        launcher, emulator, tmp_path, "--storage-timeout", "10m", checkpoints=f"gs://{emulator.bucket}/ckpt"
    )
    with _hanging(emulator):
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait(120) == ExitCode.PREEMPTED, launch.stderr
    assert "waiting up to 9 s (a stopping run's limit) to list the checkpoints" in launch.stderr
    assert "cannot list the checkpoints (no answer within 9 s, a stopping run's limit)" in launch.stderr
    assert "the run's end is not recorded" in launch.stderr
    assert "Traceback" not in launch.stderr and "internal error" not in launch.stderr
    assert launch.survivors() == []


def test_run_dir_storage_dead_past_the_lease_ends_the_run_with_its_own_exit_code(
    launcher, emulator, tmp_path
):
    launch = _start(launcher, emulator, tmp_path, "--lease", "6s")
    emulator.kill()
    assert launch.wait(120) == ExitCode.STORAGE_LOST, launch.stderr
    errors = [line for line in launch.stderr.splitlines() if line.startswith("ftlaunch: error:")]
    assert len(errors) == 1 and "has not answered for" in errors[0] and "--lease 6 s" in errors[0], errors
    assert "Traceback" not in launch.stderr and "internal error" not in launch.stderr
    assert launch.survivors() == []

    # Once storage is back, the same command resumes the run: its attempt was left running.
    emulator.restart()
    assert run_state(f"gs://{emulator.bucket}/runs/deaf").attempts[-1].outcome is None
    (tmp_path / "go").touch()
    again = launcher.run(
        "--nproc", "1", "--run-dir", f"gs://{emulator.bucket}/runs", "--run-name", "deaf",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--lease", "6s",
        WAITER, "--go-file", str(tmp_path / "go"), env=emulator.env, timeout=120,
    )  # fmt: skip
    assert again.proc.returncode == 0, again.stderr
    assert "took the run over" in again.stderr
    assert run_state(f"gs://{emulator.bucket}/runs/deaf").status.value == "SUCCEEDED"


@pytest.mark.parametrize("outage", [10, 40])
def test_a_run_dir_storage_outage_shorter_than_the_lease_does_not_end_the_run(
    launcher, emulator, tmp_path, outage
):
    launch = _start(launcher, emulator, tmp_path)
    emulator.kill()
    time.sleep(outage)  # the fault itself: storage away this long
    emulator.restart()
    (tmp_path / "go").touch()
    assert launch.wait(180) == 0, launch.stderr
    assert run_state(f"gs://{emulator.bucket}/runs/deaf").status.value == "SUCCEEDED"
    assert "Traceback" not in launch.stderr
    assert launch.survivors() == []


# In a mount namespace of the supervisor's own (its workers inherit it), /dev/shm is a 64 KiB
# tmpfs filled to its last byte before ftlaunch starts.
_FULL_SHM = """
import ctypes, subprocess
if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS
    raise OSError(ctypes.get_errno(), "unshare")
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/dev/shm"], check=True)
with open("/dev/shm/filler", "wb", buffering=0) as handle:
    for size in (4096, 1):
        try:
            while True:
                handle.write(bytes(size))
        except OSError:
            pass
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace with a tmpfs of its own needs root")
def test_a_full_dev_shm_at_launch_puts_the_heartbeat_slots_in_the_temp_dir(launcher, tmp_path):
    launch = launcher.run(
        "--nproc", "2", "--heartbeat-timeout", "30s", str(SCRIPTS / "beater.py"), "--steps", "20",
        prelude=_FULL_SHM, timeout=120,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr  # was: SIGBUS (exit 135), no word
    fallback = [line for line in launch.stderr.splitlines() if "heartbeat slots in" in line]
    assert len(fallback) == 1 and "/dev/shm has no room (No space left on device)" in fallback[0], fallback
    assert "[0] " in launch.stdout and "Traceback" not in launch.stderr
    left = list(Path(tempfile.gettempdir()).glob(f"ftlaunch-heartbeat-owned-{launch.proc.pid}-*"))
    assert left == []
    assert launch.survivors() == []


# A line of grpc's C core (absl's format): "I1128 03:12:31.742388    7556 ssl_transport_security.cc:2563] ..."
_GRPC_LINE = re.compile(r"^(?:\[\d+\] )?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\] ", re.M)


def test_grpc_says_nothing_on_the_console_for_the_supervisors_check_of_gcs(launcher, emulator):
    """gcsfs (2026.10, unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false) asks a GCS endpoint for each
    bucket's layout over gRPC: against an emulator's plain HTTP port each TLS handshake fails, and
    grpc printed every failure on the console ('ssl_transport_security.cc:2563] Handshake failed',
    an INFO line) while the supervisor checked the checkpoint dir. grpc runs at ERROR under
    ftlaunch, unless the user set GRPC_VERBOSITY."""
    # An emulator of its own: in two full runs the session's was gone by the time this module's
    # tests after the storage outages ran on the same test worker (connection refused).
    env = {**emulator.env, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "true"}  # gcsfs's own default
    launch = launcher.start(
        "--storage-timeout", "4", "--checkpoint-dir", f"gs://{emulator.bucket}/ckpt", WAITER, env=env
    )
    assert launch.wait(60) == ExitCode.USAGE, launch.stderr  # the look-up's retries outlast the check
    assert "did not answer within 4 s" in launch.stderr, launch.stderr
    assert not _GRPC_LINE.search(launch.stderr), launch.stderr
    assert launch.survivors() == []


# Connects to argv[1] with TLS and says whether the handshake failed (the server speaks HTTP).
_TLS_CLIENT = """
import sys, threading, grpc
failed = threading.Event()
def watch(state):
    if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        failed.set()
channel = grpc.secure_channel(sys.argv[1], grpc.ssl_channel_credentials())
channel.subscribe(watch, try_to_connect=True)
print("handshake failed" if failed.wait(30) else "no answer", flush=True)
channel.unsubscribe(watch)
channel.close()
"""


@pytest.mark.parametrize("level", [None, "INFO"], ids=["default", "user's INFO"])
def test_grpc_in_a_worker_says_only_its_errors_unless_the_user_asks_for_more(
    launcher, tmp_path, gcs_env, level
):
    """A rank whose gRPC channel fails its TLS handshake (as gcsfs's look-up against an emulator
    does): grpc's INFO line about it stays off the console; a GRPC_VERBOSITY the user set is kept
    (then the line shows: the level is a default, not a filter)."""
    script = tmp_path / "tls_client.py"
    script.write_text(_TLS_CLIENT)
    endpoint = gcs_env["FSSPEC_GCS_ENDPOINT_URL"].split("://")[1]
    env = {"GRPC_VERBOSITY": level} if level else {}
    spawner = ("--no-fork-server",) if level else ()  # what users run, and the other way once
    launch = launcher.run("--nproc", "1", *spawner, str(script), endpoint, env=env)
    assert launch.proc.returncode == 0, launch.stderr
    assert "[0] handshake failed" in launch.stdout, launch.stdout
    assert bool(_GRPC_LINE.search(launch.stderr)) is (level == "INFO"), launch.stderr
    assert launch.survivors() == []


# Writes and reads argv[1]'s objects through worker_lib's storage, a few times.
_STORAGE_USER = """
import sys
from worker_lib.core.storage import Storage
storage = Storage(sys.argv[1])
for n in range(4):
    storage.write_bytes(f"object_{n}", b"x")
    assert storage.read_bytes(f"object_{n}") == b"x"
print("4 objects written and read", flush=True)
"""


def test_gcsfs_falling_back_from_its_bucket_look_up_says_so_once_a_process(
    launcher, tmp_path, emulator, monkeypatch
):
    """With STORAGE_EMULATOR_HOST (or on GCS without the storage layout permission), gcsfs's gRPC
    look-up of the bucket's layout fails and it says 'Could not determine bucket type ... falling
    back to GCSFileSystem' at every call, never caching the answer: 29 lines for 2 ranks' 6 steps.
    Once a process now, the supervisor's and each rank's; the run is as before."""
    bucket = emulator.bucket  # an emulator of its own: see the test above
    for name in emulator.env:  # the launch reaches the emulator as STORAGE_EMULATOR_HOST only
        monkeypatch.delenv(name)
    script = tmp_path / "storage_user.py"
    script.write_text(_STORAGE_USER)
    env = {
        "STORAGE_EMULATOR_HOST": emulator.env["FSSPEC_GCS_ENDPOINT_URL"],
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "true",
    }
    url = f"gs://{bucket}"
    launch = launcher.run(
        "--nproc", "1", "--checkpoint-dir", f"{url}/ckpt", str(script), f"{url}/own", env=env
    )
    assert launch.proc.returncode == 0, launch.stderr
    assert "[0] 4 objects written and read" in launch.stdout, launch.stdout
    said = [line for line in launch.stderr.splitlines() if "Could not determine bucket type" in line]
    assert len([line for line in said if line.startswith("[0] ")]) == 1, launch.stderr
    assert len(said) <= 2, launch.stderr  # and ftlaunch's own check of the checkpoint dir, once
    assert launch.survivors() == []
