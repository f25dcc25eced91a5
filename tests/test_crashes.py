"""Workers that really die: the group is stopped, restarted within the budget, and the root
cause is reported. Every test also checks (fixture) that no process survives it."""

import json
import os
import signal
import time

import psutil
import pytest
from helpers import ACTOR, frozen_at

from launcher.core.events import InternalError, Transition, WorkerExit

# The crashes are the subject, not how the workers start (tests/test_fork_server.py has forked ones'
# ends): the actor's workers are new processes here.
pytestmark = pytest.mark.exec_workers

ROOT_CAUSES = {
    "exit": "exit code 1",
    "sigkill": "Signal 9 (SIGKILL)",
    "segv": "Signal 11 (SIGSEGV)",
    "raise": "ValueError: boom on rank 1 (exit code 1)",
}


@pytest.mark.parametrize("how", sorted(ROOT_CAUSES))
def test_crash_restarts_whole_group_then_succeeds(launcher, how):
    launch = launcher.run("--nproc", "3", str(ACTOR), "--fail", how, "--others", "wait", "--run-for", "0.5")

    assert launch.proc.returncode == 0, launch.stderr
    assert "attempt 0: rank 1 (pid" in launch.stderr
    assert ROOT_CAUSES[how] in launch.stderr
    assert launch.survivors() == []
    # The whole group was stopped: ranks 0 and 2 of attempt 0 were still running when rank 1 died.
    exits = [(e.attempt, e.rank) for e in launch.events(WorkerExit)]
    assert (0, 0) not in exits and (0, 2) not in exits
    assert sorted(r for a, r in exits if a == 1) == [0, 1, 2]
    states = [(e.attempt, e.new) for e in launch.events(Transition)]
    assert states == [
        (0, "STARTING"),
        (0, "RUNNING"),
        (0, "FAILED"),
        (0, "STOPPING"),
        (0, "STOPPED"),
        (1, "STARTING"),
        (1, "RUNNING"),
        (1, "SUCCEEDED"),
    ]


def test_restart_count_reaches_workers(launcher, tmp_path):
    envs = tmp_path / "env"
    launch = launcher.run(
        "--nproc", "2", str(ACTOR), "--fail", "exit", "--fail-attempts", "0,1", "--env-dir", str(envs)
    )
    assert launch.proc.returncode == 0, launch.stderr
    for attempt in range(3):
        for rank in range(2):
            env = json.loads((envs / f"rank_{rank}.attempt_{attempt}.json").read_text())
            assert env["TORCHELASTIC_RESTART_COUNT"] == env["FTLAUNCH_ATTEMPT"] == str(attempt)
    assert len(list(envs.iterdir())) == 6


def test_budget_spent_exits_nonzero_with_every_failure_and_the_log_tail(launcher):
    launch = launcher.run(
        "--nproc",
        "2",
        "--max-failures",
        "2",
        "--crash-loop",
        "0",
        str(ACTOR),
        "--fail",
        "exit",
        "--fail-attempts",
        "all",
        "--others",
        "sleep",
    )

    assert launch.proc.returncode == 1
    assert (
        "FAILED after 3 attempt(s), 3 failed group(s): failure budget spent (3 failures, 2 allowed)"
        in launch.stderr
    )
    for attempt in range(3):
        assert f"attempt {attempt}: rank 1 (pid" in launch.stderr
    assert "root cause: rank 1" in launch.stderr
    assert "| rank 1 about to fail by exit" in launch.stderr  # the last lines of rank 1's log
    assert launch.survivors() == []


def test_exception_root_cause_shows_the_traceback(launcher):
    launch = launcher.run(
        "--nproc", "2", "--max-failures", "0", str(ACTOR), "--fail", "raise", "--others", "sleep"
    )

    assert launch.proc.returncode == 1
    assert "no failures allowed" in launch.stderr
    assert "root cause: rank 1 (pid" in launch.stderr and "ValueError: boom on rank 1" in launch.stderr
    assert "traceback (from TORCHELASTIC_ERROR_FILE)" in launch.stderr
    assert 'raise ValueError(f"boom on rank {RANK}")' in launch.stderr


def test_ranks_that_succeed_while_another_fails_still_fail_the_group(launcher, tmp_path):
    # Rank 0 exits 0 at once; rank 1 fails once ftlaunch has reaped rank 0 (on a loaded machine
    # rank 0 may take seconds to start, or to exit with torch loaded). The group failed: both run
    # again.
    exited = tmp_path / "rank0_exits"
    launch = launcher.run(
        "--nproc", "2", str(ACTOR), "--fail", "exit", "--fail-after", "0.1", "--run-for", "0",
        "--exit-file", str(exited),
    )  # fmt: skip

    assert launch.proc.returncode == 0, launch.stderr
    exits = [(e.attempt, e.rank, e.exitcode) for e in launch.events(WorkerExit)]
    assert (0, 0, 0) in exits and (0, 1, 1) in exits
    assert {(a, r, c) for a, r, c in exits if a == 1} == {(1, 0, 0), (1, 1, 0)}  # then both succeed


def test_ranks_dead_before_the_stop_are_each_a_failure_and_one_the_stop_ended_is_not(launcher, tmp_path):
    """Rank 0 kills itself; the supervisor is held at the moment it saw that (a failpoint), while
    ranks 1 and 2 are killed too: eight ranks killed at once were recorded as one or two, the
    others counted as stopped. They died before the stop: each is a failure. Rank 3 turns the
    stop's SIGTERM into KeyboardInterrupt and so ends by SIGINT: the stop's doing, no failure,
    and never the root cause."""
    ready = tmp_path / "ready"
    launch = launcher.start(
        "--nproc", "4", "--max-failures", "0", str(ACTOR), "--fail", "sigkill", "--fail-rank", "0",
        "--fail-after", "0", "--fail-when-all-ready", "--ready-dir", str(ready), "--others", "sleep",
        "--trap", "interrupt", env={"FTLAUNCH_FAILPOINT": "failure-seen"},
    )  # fmt: skip
    frozen_at(launch, "failure-seen")
    for rank in (1, 2):
        pid = int((ready / f"rank_{rank}.attempt_0.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        _until(lambda pid=pid: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)  # dead, not reaped
    os.kill(launch.proc.pid, signal.SIGCONT)

    assert launch.wait(120) == 1, launch.stderr
    (attempt,) = launch.run_state().attempts
    assert [(f.rank, f.detail.split(": ", 1)[1]) for f in attempt.failures] == [
        (0, "Signal 9 (SIGKILL)"),  # the root cause: seen first
        (1, "Signal 9 (SIGKILL)"),
        (2, "Signal 9 (SIGKILL)"),
    ]
    assert launch.survivors() == []


def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.01)


def test_unlimited_failures(launcher):
    launch = launcher.run(
        "--nproc",
        "1",
        "--max-failures",
        "-1",
        "--crash-loop",
        "0",
        str(ACTOR),
        "--fail",
        "exit",
        "--fail-rank",
        "0",
        "--fail-attempts",
        "0,1,2,3",
        "--fail-after",
        "0",
    )
    assert launch.proc.returncode == 0, launch.stderr
    assert "failure 4 (no limit)" in launch.stderr


# A defect planted in ftlaunch itself: the monitor loop raises once the workers run.
_DEFECT = """
import launcher.agent.attempt as attempt
def _defect(self, *args):
    raise RuntimeError("a defect planted by the test")
attempt.AttemptRunner._publish_progress = _defect
"""


def test_a_defect_in_ftlaunch_stops_the_workers_shows_its_traceback_and_exits_70(launcher):
    launch = launcher.run(
        "--nproc", "2", str(ACTOR), "--others", "sleep", "--run-for", "60", prelude=_DEFECT, timeout=60
    )  # fmt: skip
    assert launch.proc.returncode == 70, launch.stderr
    assert "RuntimeError: a defect planted by the test" in launch.stderr  # the traceback
    assert "attempt 0: internal error (RuntimeError: a defect planted by the test)" in launch.stderr
    assert "ftlaunch: internal error (exit 70)" in launch.stderr.splitlines()[-1]
    assert any(e.new == "RUNNING" for e in launch.events(Transition))  # workers had started
    [recorded] = launch.events(InternalError)
    assert recorded.attempt == 0 and "_defect" in recorded.traceback
    assert launch.survivors_after() == []
