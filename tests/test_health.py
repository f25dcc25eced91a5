"""A node's health check before it joins and before each restart, with real processes: a failing
--health-check (exit 8, its output, run.json), one that hangs past its timeout (killed with
everything it started), SIGTERM during one, one that fails only before the restart, checkpoint
storage that broke between attempts, and a follower that fails its check on a 2-node job."""

import os
import signal
import socket
import time

import psutil
import pytest
from helpers import ACTOR, read_logged, until

from launcher.core.events import HealthChecked, RoundAbandoned, of_kind

# The check's rules hold however the workers start: torch-free ranks, started plainly.
pytestmark = pytest.mark.exec_workers

UNHEALTHY = 8


def _checks(launch):
    return [(e.before, e.healthy, e.failed) for e in launch.events(HealthChecked)]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_failing_check_on_the_only_node_exits_8_before_any_worker_starts(launcher, tmp_path):
    check = 'echo "checking node $FTLAUNCH_NODE_RANK"; echo "GPU 3: 2 uncorrectable ECC errors" >&2; exit 3'
    ready = tmp_path / "ready"
    launch = launcher.run("--health-check", check, ACTOR, "--ready-dir", str(ready))

    assert launch.proc.returncode == UNHEALTHY, launch.stderr
    line = "node 0 is unhealthy: --health-check failed: exit 3; last output: checking node 0 | GPU 3: 2"
    assert line in launch.stderr
    assert "drain or replace it" in launch.stderr
    assert not ready.exists()  # no rank ever started
    state = launch.run_state()
    assert (state.status, state.exit_code, state.attempts) == ("STOPPED", UNHEALTHY, [])
    assert state.reason.startswith(line)
    assert "GPU 3: 2 uncorrectable ECC errors" in (launch.log_dir / "health.log").read_text()
    assert _checks(launch) == [("start", False, "--health-check")]


def test_a_failing_check_leaves_nothing_it_started_behind_exit_8(launcher, tmp_path):
    """A check that fails with a child still running: exit 8 leaves no process, as a check past
    its timeout leaves none (its background child outlived ftlaunch, reparented to init)."""
    pids = tmp_path / "pids"
    check = f"sleep 300 & echo $! >> {pids}; setsid sleep 300 & echo $! >> {pids}; exit 1"
    launch = launcher.run("--health-check", check, ACTOR)

    assert launch.proc.returncode == UNHEALTHY, launch.stderr
    assert "--health-check failed: exit 1" in launch.stderr
    started_by_check = [int(pid) for pid in pids.read_text().split()]
    assert len(started_by_check) == 2  # a child in its group, one in a session of its own
    assert launch.survivors_after(timeout=10) == []
    assert [pid for pid in started_by_check if not _gone(pid)] == []


def test_a_check_past_its_timeout_is_killed_with_all_it_started(launcher, tmp_path):
    pids = tmp_path / "pids"
    check = (
        f"sleep 300 & echo $! >> {pids}; setsid sleep 300 & echo $! >> {pids}; "
        f"echo $$ >> {pids}; echo looking; sleep 300"
    )
    started = time.monotonic()
    launch = launcher.run("--health-check", check, "--health-check-timeout", "1s", ACTOR)

    assert launch.proc.returncode == UNHEALTHY, launch.stderr
    assert time.monotonic() - started < 60
    assert "--health-check failed: no answer within 1 s (--health-check-timeout): killed" in launch.stderr
    assert "last output: looking" in launch.stderr
    started_by_check = [int(pid) for pid in pids.read_text().split()]
    assert len(started_by_check) == 3  # its shell, a child in its group, one in a session of its own
    assert [pid for pid in started_by_check if not _gone(pid)] == []


def test_sigterm_during_a_long_check_ends_the_launch_at_once(launcher, tmp_path):
    pid_file = tmp_path / "check.pid"
    launch = launcher.start("--health-check", f"echo $$ > {pid_file}; exec sleep 300", ACTOR)
    until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=60)
    check_pid = int(pid_file.read_text())
    sent = time.monotonic()
    os.kill(launch.proc.pid, signal.SIGTERM)
    code = launch.wait(60)

    assert code == 143, launch.stderr
    assert time.monotonic() - sent < 5.0  # not the check's 300 s, nor its 60 s timeout
    assert "interrupted by SIGTERM during this node's health check" in launch.stderr
    assert _gone(check_pid)
    assert _checks(launch) == []  # it never finished: no verdict


def test_a_check_that_fails_only_before_the_restart(launcher, tmp_path):
    ready = tmp_path / "ready"
    crashed = ready / "rank_0.attempt_0.pid"  # the first attempt's rank leaves it, then crashes
    check = f'test ! -e {crashed} || {{ echo "found {crashed.name}: GPU fell off the bus"; exit 1; }}'
    command = (ACTOR, "--fail", "exit", "--fail-rank", "0", "--ready-dir", str(ready))
    launch = launcher.run("--health-check", check, *command)

    assert launch.proc.returncode == UNHEALTHY, launch.stderr
    assert "attempt 0 failed: rank 0" in launch.stderr
    assert "node 0 is unhealthy: --health-check failed: exit 1; last output: found rank_0.attempt_0.pid" in (
        launch.stderr
    )
    assert "(before a restart;" in launch.stderr
    assert not (ready / "rank_0.attempt_1.pid").exists()  # the restart never started
    assert _checks(launch) == [("start", True, ""), ("restart", False, "--health-check")]
    state = launch.run_state()
    assert (state.status, state.exit_code) == ("STOPPED", UNHEALTHY)
    assert [a.outcome for a in state.attempts] == ["FAILED"]  # what ran is kept, the end recorded

    # On a healthy node (here: a check that passes) the same command resumes the run.
    again = launcher.run("--health-check", "true", *command)
    assert again.proc.returncode == 0, again.stderr
    assert "resuming (STOPPED, 1 attempt(s)" in again.stderr
    assert [a.outcome for a in again.run_state().attempts] == ["FAILED", "SUCCEEDED"]


def test_checkpoint_storage_that_broke_between_attempts_is_said_and_left_to_the_lease(launcher, tmp_path):
    """Storage unwritable for root too: the checkpoint folder's path now names a file (chmod would
    not do: root writes through it). A failed write before a restart is no verdict on the node
    (shared storage that stopped answering fails every node alike; a blip is not a death): it is
    said, the restart goes on, and storage's loss stays the run dir lease's to judge (exit 7)."""
    ckpt = tmp_path / "ckpt"
    breaks = (
        f'if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then rm -rf {ckpt}; echo "not a folder" > {ckpt}; '
        "exit 1; fi"
    )
    launch = launcher.run("--checkpoint-dir", str(ckpt), "--no-python", "/bin/sh", "-c", breaks)

    assert launch.proc.returncode == 0, launch.stderr
    assert "before the restart: checkpoint storage (--checkpoint-dir)" in launch.stderr
    assert _checks(launch) == [("start", True, ""), ("restart", True, "")]
    [restart] = [e for e in launch.events(HealthChecked) if e.before == "restart"]
    assert "checkpoint storage" in restart.unknown
    assert [a.outcome for a in launch.run_state().attempts] == ["FAILED", "SUCCEEDED"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(300)
def test_a_follower_that_fails_its_check_before_the_restart_leaves_and_node_0_says_why(launcher, tmp_path):
    """Node 1's rank crashes in attempt 0; node 1's check then fails (the same command on both
    nodes: FTLAUNCH_NODE_RANK tells them apart). Node 1 exits 8 and tells node 0, which says why
    it misses node 1, waits --join-timeout for a node in its place, and stops (exit 5): resumable.
    (--join-timeout 15 s: node 0's start, torch's import for its store included, fits on a busy
    machine.)"""
    ready = tmp_path / "ready"
    crashed = ready / "rank_1.attempt_0.pid"
    check = (
        f'[ "$FTLAUNCH_NODE_RANK" = 0 ] || test ! -e {crashed} || {{ echo "ECC errors on GPU 2"; exit 1; }}'
    )
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = []
    for rank in (0, 1):
        nodes.append(
            launcher.start(
                *("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint),
                *("--node-timeout", "2s", "--join-timeout", "15s", "--health-check", check),
                *(ACTOR, "--fail", "exit", "--fail-rank", "1", "--ready-dir", str(ready)),
                log_dir=tmp_path / f"logs{rank}",
                env={"GLOO_SOCKET_IFNAME": "lo"},
            )
        )
    node0, node1 = nodes
    node0.log_dir = node0.log_dir / "node0"  # each node's logs under its own name
    assert node1.wait(120) == UNHEALTHY, node1.stderr
    assert node0.wait(120) == 5, node0.stderr

    said = "node 1 is unhealthy: --health-check failed: exit 1; last output: ECC errors on GPU 2"
    assert said in node1.stderr
    assert "node 1 left the job: node 1 is unhealthy: --health-check failed" in node0.stderr
    assert "within --join-timeout (15 s)" in node0.stderr  # its round, or the next, waited out
    abandoned = [e.reason for e in node0.events(RoundAbandoned)]  # at the notice, not a deadline
    assert abandoned[:1] == ["node(s) 1 left the job unhealthy, and the round counted on them"], abandoned
    node1_checks = read_logged(tmp_path / "logs1" / "node1" / "events.jsonl")
    assert [(e.event.before, e.event.healthy) for e in of_kind(node1_checks, HealthChecked)] == [
        ("start", True),
        ("restart", False),
    ]
    state = node0.run_state()
    assert (state.status, state.exit_code) == ("STOPPED", 5)  # node 0's record: the job waits for a node
    assert [a.outcome for a in state.attempts] == ["FAILED"]  # rank 1's crash, counted as any


@pytest.mark.timeout(300)
def test_an_unhealthy_node_0_leaves_the_job_open_for_its_relaunch(launcher, tmp_path):
    """Node 0 fails its first check: exit 8, and its rendezvous is not closed, so node 1 waits for
    node 0 as for a lost one (exit 5 at --join-timeout: resumable), not "the job had ended" (6)."""
    check = '[ "$FTLAUNCH_NODE_RANK" != 0 ] || { echo "no InfiniBand link"; exit 1; }'
    endpoint = f"127.0.0.1:{_free_port()}"
    ready = tmp_path / "ready"
    nodes = [
        launcher.start(
            *("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint),
            *("--node-timeout", "2s", "--join-timeout", "5s", "--health-check", check),
            *(ACTOR, "--ready-dir", str(ready)),
            log_dir=tmp_path / f"logs{rank}",
            env={"GLOO_SOCKET_IFNAME": "lo"},
        )
        for rank in (0, 1)
    ]
    node0, node1 = nodes
    assert node0.wait(120) == UNHEALTHY, node0.stderr
    assert node1.wait(120) == 5, node1.stderr

    said = "node 0 is unhealthy: --health-check failed: exit 1; last output: no InfiniBand link"
    assert said in node0.stderr
    assert "--join-timeout" in node1.stderr
    assert not ready.exists()  # no rank started anywhere
    assert node0.run_state().exit_code == UNHEALTHY


@pytest.mark.timeout(300)
def test_a_follower_that_fails_its_first_check_never_joins(launcher, tmp_path):
    """Node 1 fails before it reaches node 0: it exits 8 without a claim, a hello or a round, and
    node 0 waits for it as for any node that did not come (exit 5 at --join-timeout)."""
    check = '[ "$FTLAUNCH_NODE_RANK" != 1 ] || { echo "/scratch is not mounted"; exit 1; }'
    endpoint = f"127.0.0.1:{_free_port()}"
    ready = tmp_path / "ready"
    node0, node1 = [
        launcher.start(
            *("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint),
            *("--node-timeout", "2s", "--join-timeout", "6s", "--health-check", check),
            *(ACTOR, "--ready-dir", str(ready)),
            log_dir=tmp_path / f"logs{rank}",
            env={"GLOO_SOCKET_IFNAME": "lo"},
        )
        for rank in (0, 1)
    ]
    assert node1.wait(120) == UNHEALTHY, node1.stderr
    assert node0.wait(120) == 5, node0.stderr

    assert "node 1 is unhealthy: --health-check failed: exit 1; last output: /scratch is not mounted" in (
        node1.stderr
    )
    assert "(before its first attempt;" in node1.stderr
    assert "waiting for node 0" not in node1.stderr  # it never tried to reach node 0
    assert "left the job" not in node0.stderr  # nothing to tell: node 1 never came
    assert not ready.exists()


def test_a_check_outlives_no_kill_9_of_ftlaunch(launcher, tmp_path):
    """The orphan guard watches the check's process group as it watches the workers'."""
    pid_file = tmp_path / "check.pid"
    launch = launcher.start("--health-check", f"echo $$ > {pid_file}; exec sleep 300", ACTOR)
    until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=60)
    os.kill(launch.proc.pid, signal.SIGKILL)
    launch.wait(30)

    assert launch.survivors_after(timeout=10) == []
    assert _gone(int(pid_file.read_text()))
