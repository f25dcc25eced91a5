"""Two runs on one machine in separate PID namespaces (containers sharing /dev/shm, ``docker
--ipc=host``; ``unshare --pid``), where neither's pid exists for the other: what a supervisor
keeps in /dev/shm (the memory tier's folder, the heartbeat file) is removed by a later ftlaunch
only once its owner's flock is gone, and a live run's lock is judged by its lease."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, SCRIPTS, memory_folders, run_state

from launcher.core.owned import pid_space

pytestmark = pytest.mark.exec_workers  # torch-free launches: how workers start is not the subject

SHM = Path("/dev/shm")
WAITER = str(SCRIPTS / "waiter.py")
# a process in another PID namespace, as in a container sharing the host's /dev/shm
UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc")


def _heartbeat_files(pid: int):
    return list(SHM.glob(f"ftlaunch-heartbeat-owned-{pid}-*"))


@pytest.fixture
def other_namespace():
    if os.geteuid() != 0:
        pytest.skip("unshare --pid needs root (CI and dev machines run as root)")
    return UNSHARE


def test_a_run_in_another_pid_namespace_leaves_a_live_runs_files_alone(launcher, tmp_path, other_namespace):
    go = tmp_path / "go"
    first = launcher.start("--nproc", "1", WAITER, "--go-file", str(go))
    first.read_console_until(lambda line: "waits for" in line, timeout=60)
    (folder,) = memory_folders(first.proc.pid)
    (beats,) = _heartbeat_files(first.proc.pid)
    # Its own supervisor is pid 1 there: the first run's pid does not exist in its namespace.
    done = tmp_path / "done"
    done.touch()
    second = launcher.start(
        "--nproc", "1", "--run-name", "other", WAITER, "--go-file", str(done), wrap=other_namespace
    )
    second.wait(60)
    assert second.proc.returncode == 0, second.stderr  # it made its tier and its board: it cleaned
    assert memory_folders(1) == [] and _heartbeat_files(1) == []  # and removed its own at its end
    assert folder.is_dir() and beats.is_file()  # was: both deleted under the live run
    go.touch()
    first.wait(60)
    assert first.proc.returncode == 0, first.stderr
    assert "rank 0 done" in first.stdout
    assert memory_folders(first.proc.pid) == [] and _heartbeat_files(first.proc.pid) == []
    assert first.survivors() == [] and second.survivors() == []


def test_a_run_in_another_pid_namespace_does_not_take_a_live_run_over(launcher, tmp_path, other_namespace):
    go, done = tmp_path / "go", tmp_path / "done"
    done.touch()
    args = ("--nproc", "1", "--run-name", "same", "--lease", "3", WAITER, "--go-file")
    first = launcher.start(*args, str(go))
    first.read_console_until(lambda line: "waits for" in line, timeout=60)
    second = launcher.start(*args, str(done), wrap=other_namespace)
    second.wait(60)
    # was: "took the run over from <host> pid <first's>: dead", and both ran it
    assert second.proc.returncode == 2, second.stderr
    assert "it renewed its lease while this launch waited: it is alive" in second.stderr
    go.touch()
    first.wait(60)
    assert first.proc.returncode == 0, first.stderr
    assert run_state(tmp_path / "runs" / "same").status == "SUCCEEDED"
    assert first.survivors() == [] and second.survivors() == []


@pytest.mark.parametrize("proc", [("--mount-proc",), ()], ids=["own-proc", "host-proc"])
def test_the_pid_space_a_record_names_tells_another_namespace_apart(other_namespace, proc):
    """What the run lock and the lobby's claims record beside a pid, in a container with its own
    /proc or with the host's."""
    ask = [sys.executable, "-c", "from launcher.core.owned import pid_space; print(pid_space())"]
    there = subprocess.run(
        ["unshare", "--pid", "--fork", *proc, *ask], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert there.returncode == 0, there.stderr
    assert there.stdout.strip().startswith(f"{socket.gethostname()}/pidns-")
    assert there.stdout.strip() != pid_space()


def test_what_a_killed_owner_left_is_removed_by_the_next_one(tmp_path):
    """No orphan guard here: the owner's files stay after its SIGKILL until a later owner looks."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        folder, beats = (Path(p) for p in owner.stdout.readline().split())
        os.kill(owner.pid, signal.SIGKILL)
        assert owner.wait(10) == -signal.SIGKILL
    finally:
        owner.kill()
        owner.wait(10)
    assert folder.is_dir() and beats.is_file()
    assert not psutil.pid_exists(owner.pid)
    tier, board = subprocess.run(
        [sys.executable, "-c", _OWNER], cwd=ROOT, input="", capture_output=True, text=True, timeout=30
    ).stdout.split()
    assert not folder.exists() and not beats.exists()
    assert not Path(tier).exists() and not Path(board).exists()  # that one ended: it removed its own


# Makes the memory tier and a heartbeat board, says where, and keeps them until stdin closes.
_OWNER = """
import sys
from launcher.process.memory_tier import MemoryTier
from launcher.hangs.board import HeartbeatBoard
tier, board = MemoryTier(), HeartbeatBoard(1, attempt=0)
print(tier.folder, board.path, flush=True)
sys.stdin.read()
board.close()
tier.close()
"""
