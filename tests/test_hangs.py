"""Hangs under ftlaunch: real workers that stop beating (a sleep, SIGSTOP, a collective left
waiting), detected by deadline, their stacks dumped into their logs, the group restarted."""

import re

import pytest
from helpers import SCRIPTS, wait_for_files

from launcher.core.events import FirstStep, Hang, HeartbeatDeadline, Transition

BEATER = str(SCRIPTS / "beater.py")


def _transitions(launch, attempt):
    return [e.new for e in launch.events(Transition) if e.attempt == attempt]


def test_a_sleeping_rank_is_detected_with_its_stack_and_the_group_restarts(launcher):
    launch = launcher.run("--nproc", "2", "--heartbeat-timeout", "2", BEATER, "--hang", "sleep")

    assert launch.proc.returncode == 0, launch.stderr
    (hang,) = launch.events(Hang)
    assert hang.rank == 1 and hang.last_step == 9 and hang.phase == "stepping"
    assert 2.0 < hang.silent_for < 3.0  # detected within the timeout plus 1 s
    assert _transitions(launch, 0) == ["STARTING", "RUNNING", "HUNG", "STOPPING", "STOPPED"]
    rank_1 = (launch.log_dir / "attempt_0" / "rank_1.log").read_text()
    assert re.search(
        r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n.*line \d+ in sleep_forever", rank_1
    )
    assert "rank 1 (pid" in launch.stderr and "hung: no heartbeat for 2." in launch.stderr
    assert "after step 9, in sleep_forever (beater.py:" in launch.stderr
    assert (
        "[0] rank 0 done after 30 steps" in launch.stdout
        and "[1] rank 1 done after 30 steps" in launch.stdout
    )
    assert launch.survivors() == []


def test_a_stopped_rank_is_detected_and_cleaned_up(launcher):
    launch = launcher.run("--nproc", "2", "--heartbeat-timeout", "1", BEATER, "--hang", "stop")

    assert launch.proc.returncode == 0, launch.stderr
    (hang,) = launch.events(Hang)
    assert hang.rank == 1
    assert "process stopped" in launch.stderr
    assert "[1] rank 1 done after 30 steps" in launch.stdout
    assert launch.survivors() == []


def test_peers_blocked_in_a_collective_are_stopped_and_the_hung_rank_is_blamed(launcher):
    launch = launcher.run(
        "--nproc",
        "3",
        "--heartbeat-timeout",
        "2",
        "--max-failures",
        "0",
        BEATER,
        "--hang",
        "sleep",
        "--collective",
    )

    assert launch.proc.returncode == 1, launch.stderr
    # Every rank went silent at about the same step: each is named, though on a busy machine one
    # passes its deadline a few beats before the others; the blame goes to the one that is not
    # waiting in a collective.
    assert sorted(h.rank for h in launch.events(Hang)) == [0, 1, 2]
    assert "root cause: rank 1 (pid" in launch.stderr and "in sleep_forever" in launch.stderr
    # Its stack as shown starts at the script, as a plain interpreter's would: not the fork
    # server's frames, nor runpy's, below it.
    shown = [line for line in launch.stderr.splitlines() if line.startswith("[ftlaunch]   | File ")]
    assert shown[0].endswith("in sleep_forever") and shown[-1].endswith(" in <module>"), shown
    assert all("beater.py" in line for line in shown), shown
    for rank in (0, 2):  # the peers' stacks show where they waited
        log = (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()
        assert re.search(r"line \d+ in all_reduce", log), log
    assert launch.survivors() == []


def test_a_rank_beating_in_place_is_blamed_for_the_peer_that_waits_for_it(launcher):
    """Regression (issue 33): rank 1 loops calling heartbeat(9) and never reaches the all-reduce
    of step 10, where rank 0 waits. Only rank 0 misses the heartbeat deadline, but the blame is
    rank 1's: it beats, at one step, while its peer is silent in a collective."""
    launch = launcher.run(
        "--nproc", "2", "--heartbeat-timeout", "2", "--max-failures", "0",
        BEATER, "--hang", "beat-in-place", "--collective",
    )  # fmt: skip
    assert launch.proc.returncode == 1, launch.stderr
    named = {h.rank: h for h in launch.events(Hang)}
    assert sorted(named) == [0, 1] and named[1].stalled and not named[0].stalled
    assert "beating at one step while they wait: rank(s) 1 at step 9" in launch.stderr
    assert re.search(
        r"root cause: rank 1 \(pid \d+\): hung: beats without a new step for [\d.]+ s", launch.stderr
    )
    assert re.search(r"line \d+ in all_reduce", (launch.log_dir / "attempt_0" / "rank_0.log").read_text())
    assert launch.survivors() == []


def test_progress_timeout_catches_every_rank_beating_one_step(launcher):
    """Every rank beats step 9 forever: no beat is ever late, so only --progress-timeout sees it."""
    launch = launcher.run(
        "--nproc", "2", "--heartbeat-timeout", "30", "--progress-timeout", "2",
        BEATER, "--hang", "beat-in-place", "--hang-rank", "-1",
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr  # the restarted group runs through
    assert sorted(h.rank for h in launch.events(Hang) if h.stalled) == [0, 1]
    assert "beat without a new step past --progress-timeout" in launch.stderr
    assert _transitions(launch, 0) == ["STARTING", "RUNNING", "HUNG", "STOPPING", "STOPPED"]
    assert "[1] rank 1 done after 30 steps" in launch.stdout
    assert launch.survivors() == []


@pytest.mark.parametrize("storage", ["gcs"], indirect=True)
def test_a_save_longer_than_the_deadline_is_not_a_hang(launcher, storage):
    launch = launcher.run(
        "--nproc",
        "2",
        "--heartbeat-timeout",
        "0.5",
        "--checkpoint-dir",
        storage.url,
        BEATER,
        "--steps",
        "10",
        "--save-mb",
        "96",
        env=storage.env,
        timeout=120,
    )

    assert launch.proc.returncode == 0, launch.stderr
    took = [float(s) for s in re.findall(r"saved 96 MB in ([\d.]+) s", launch.stdout)]
    assert len(took) == 2 and min(took) > 1.0, launch.stdout  # twice the deadline, at least
    assert launch.events(Hang) == [] and "attempt 1" not in launch.stderr
    assert launch.survivors() == []


def test_a_script_that_never_beats_is_never_killed_for_silence(launcher):
    launch = launcher.run(
        "--nproc",
        "2",
        "--init-timeout",
        "0.5",
        "--heartbeat-timeout",
        "0.2",
        BEATER,
        "--no-beat",
        "--steps",
        "20",
        "--step-time",
        "0.1",
    )

    assert launch.proc.returncode == 0, launch.stderr
    assert launch.events(Hang) == []
    assert launch.stderr.count("crashes are detected, hangs are not") == 1
    assert launch.survivors() == []


def test_a_rank_frozen_inside_a_save_is_blamed_not_the_peer_that_waits_for_it(launcher):
    """Regression (the chaos matrix): a rank stopped with its heartbeat paused has the long pause
    deadline, so its peer, blocked in the next all-reduce, passes its own deadline first; the
    peer alone was named and blamed. The frozen rank is named with it, and blamed."""
    launch = launcher.run(
        "--nproc", "2", "--heartbeat-timeout", "2", BEATER, "--collective", "--hang", "stop-in-save",
        "--hang-rank", "0",
    )  # fmt: skip

    assert launch.proc.returncode == 0, launch.stderr
    hangs = {h.rank: h for h in launch.events(Hang)}
    assert hangs[0].phase == "paused" and hangs[1].phase == "stepping", hangs
    assert hangs[1].silent_for > hangs[1].deadline and hangs[0].deadline > 2.0
    failed = re.search(r"attempt 0 failed: (.*)", launch.stderr)
    assert failed and failed.group(1).startswith("rank 0 (pid"), launch.stderr
    assert "stuck in a save/load/pause" in failed.group(1) and "process stopped" in failed.group(1)
    assert launch.survivors() == []


def test_auto_deadline_follows_steps_that_slow_down_3x(launcher):
    launch = launcher.run(
        "--nproc",
        "2",
        "--heartbeat-floor",
        "0.2",
        "--max-failures",
        "0",
        BEATER,
        "--steps",
        "120",
        "--slow-from",
        "80",
        "--hang",
        "sleep",
        "--hang-rank",
        "0",
        "--hang-at",
        "115",
    )

    assert launch.proc.returncode == 1, launch.stderr
    learned = [e.seconds for e in launch.events(HeartbeatDeadline)]
    (hang,) = launch.events(Hang)
    assert hang.rank == 0 and hang.last_step == 114  # no false alarm before the real hang
    # 10x the 50 ms step, then 10x the 150 ms step (each a little more: sleeps overshoot).
    assert 0.5 <= learned[0] < 1.0 and 1.5 <= hang.deadline < 2.5, learned
    assert hang.silent_for < hang.deadline + 1.0
    assert launch.survivors() == []


def test_with_heartbeat_timeout_off_silence_is_never_a_hang(launcher):
    launch = launcher.run(
        "--nproc", "2", "--heartbeat-timeout", "off", "--heartbeat-floor", "0.5", BEATER, "--hang", "stall"
    )  # without "off", the 3 s stall is a hang (auto learns 0.5 s here)

    assert launch.proc.returncode == 0, launch.stderr
    assert "[1] rank 1 hangs at step 10 (stall)" in launch.stdout  # 3 s without a beat
    assert launch.events(Hang) == [] and "attempt 1" not in launch.stderr
    assert [e.attempt for e in launch.events(FirstStep)] == [0]  # beats still time the run
    assert launch.survivors() == []


def test_a_relaunch_knows_the_script_beats_from_the_runs_history(launcher, tmp_path):
    """After a kill -9 of ftlaunch, the relaunched supervisor has seen no beat itself; the run's
    history says the script beats, so a rank stuck before its first beat is still a hang."""
    runs = tmp_path / "runs"
    script = [
        BEATER,
        "--steps",
        "100",
        "--save-every",
        "5",
        "--hang",
        "sleep",
        "--hang-rank",
        "0",
        "--hang-attempt",
        "1",
        "--hang-at",
        "0",
    ]
    options = ["--run-dir", str(runs), "--run-name", "beater", "--init-timeout", "8", "--nproc", "1"]
    first = launcher.start(*options, *script)
    wait_for_files(runs / "beater" / "checkpoints", "step_10/COMMITTED", 1, timeout=60)
    first.proc.kill()
    first.wait()
    assert first.survivors_after(timeout=10) == []

    second = launcher.run(*options, *script, timeout=120)  # attempt 1 hangs before it beats
    assert second.proc.returncode == 0, second.stderr
    (hang,) = second.events(Hang)
    assert hang.attempt == 1 and hang.phase == "starting"
    assert second.survivors() == []
