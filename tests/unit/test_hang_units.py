"""Hang deadlines, stack-dump parsing and durations: pure logic with scripted clocks and slots."""

import dataclasses
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
from helpers import dead_pid

from launcher.core.beats import BeatReading, Phase
from launcher.core.failures import HangFailure, root_cause, short_frame
from launcher.forked.protocol import ZYGOTE_MODULE
from launcher.grammar.durations import parse_duration
from launcher.grammar.errors import UsageError
from launcher.hangs.board import HeartbeatBoard
from launcher.hangs.deadlines import MIN_SAMPLES, HangLimits, HangWatch
from launcher.hangs.stacks import last_stacks
from worker_lib.core import contract as c

_ZYGOTE = importlib.util.find_spec(ZYGOTE_MODULE).origin  # the fork server's file, as a dump names it


def slot(beats=0, step=-1, at=0.0, paused=False, pauses=0) -> BeatReading:
    return BeatReading(beats, step, at, paused, pauses, dump_signal=0, main_thread=0, pid=1)


FIXED = HangLimits(init_timeout=60.0, heartbeat_timeout=5.0)
AUTO = HangLimits(init_timeout=60.0, heartbeat_timeout=None, floor=1.0, factor=10.0)


def test_a_script_that_has_not_beaten_is_not_judged_at_all():
    watch = HangWatch(FIXED, started_at=0.0)
    readings = {0: slot(), 1: slot(paused=True, at=1.0)}
    watch.observe(readings)
    assert watch.overdue(now=10_000.0, readings=readings) == []
    assert watch.never_beat(now=61.0) and not watch.never_beat(now=59.0)


def test_fixed_deadline_between_beats():
    watch = HangWatch(FIXED, started_at=0.0)
    readings = {0: slot(beats=3, step=7, at=100.0), 1: slot(beats=3, step=7, at=102.0)}
    watch.observe(readings)
    assert watch.overdue(104.9, readings) == []
    (late,) = watch.overdue(105.5, readings)
    assert (late.rank, late.phase, late.last_step, late.deadline) == (0, Phase.STEPPING, 7, 5.0)
    assert late.silent_for == pytest.approx(5.5) and late.silent_since == 100.0


def test_ranks_that_went_silent_with_an_overdue_one_are_named_with_it():
    """Regression (CI, a busy machine): in a collective hang rank 0 passed its deadline first, and
    only it was named, so the blame fell on a peer; the hung rank 1 and rank 2, silent for over
    half the deadline, went silent with it. Rank 3, which still beats, did not."""
    watch = HangWatch(FIXED, started_at=0.0)
    readings = {
        0: slot(beats=9, step=9, at=100.0),
        1: slot(beats=9, step=9, at=100.3),
        2: slot(beats=9, step=9, at=102.0),
        3: slot(beats=40, step=40, at=105.0),
    }
    watch.observe(readings)
    assert [o.rank for o in watch.overdue(105.2, readings)] == [0]
    assert [o.rank for o in watch.silent_with(105.2, readings)] == [0, 1, 2]


def test_a_rank_stuck_in_a_save_is_named_with_the_peers_that_wait_for_it():
    """Regression (the chaos matrix, directory mode on GCS): rank 0 was frozen inside its save,
    heartbeat paused, so its own deadline was the long pause deadline; rank 1, blocked in the
    next all-reduce, passed its step deadline first and was blamed alone. Rank 0, silent as long,
    is named with it; rank 2, which paused for a save a moment ago, is not, nor is rank 3, paused
    as long but further on (done, saving its last step)."""
    watch = HangWatch(FIXED, started_at=0.0)
    readings = {
        0: slot(beats=20, step=20, at=100.1, paused=True, pauses=2),
        1: slot(beats=20, step=20, at=100.0),
        2: slot(beats=20, step=20, at=104.0, paused=True, pauses=2),
        3: slot(beats=30, step=29, at=100.1, paused=True, pauses=3),
    }
    watch.observe(readings)
    assert [o.rank for o in watch.overdue(105.5, readings)] == [1]
    assert {o.rank: o.phase for o in watch.silent_with(105.5, readings)} == {
        0: Phase.PAUSED,
        1: Phase.STEPPING,
    }
    assert watch.silent_with(101.0, readings) == []  # nobody overdue: nobody named


def test_a_rank_that_beats_in_place_while_its_peer_waits_is_named_and_blamed():
    """Regression (issue 33): rank 0 loops calling heartbeat(30) while rank 1 waits for it in the
    all-reduce of step 31. Only rank 1 misses the deadline; rank 0, beating at one step as long,
    is named with it (stalled) and blamed, before and after the stacks are known."""
    watch = HangWatch(FIXED, started_at=0.0)
    for t in (99.9, 100.0):  # both at step 30
        watch.observe({0: slot(beats=30, step=30, at=t), 1: slot(beats=30, step=30, at=t)})
    beats = 30
    for t in (101.0, 103.0, 105.4):  # rank 0 beats again and again at step 30; rank 1 is silent
        beats += 1
        readings = {0: slot(beats=beats, step=30, at=t), 1: slot(beats=30, step=30, at=100.0)}
        watch.observe(readings)
    assert [o.rank for o in watch.overdue(105.5, readings)] == [1]
    named = {o.rank: o for o in watch.silent_with(105.5, readings)}
    assert sorted(named) == [0, 1] and named[0].stalled and not named[1].stalled
    assert named[0].silent_since == 99.9 and named[0].last_step == 30

    def failure(o, frame):
        return HangFailure(o.rank, o.rank, 100 + o.rank, o.phase, o.silent_for, o.deadline, o.last_step,
                           o.silent_since, stack=(frame,) if frame else (), stalled=o.stalled)  # fmt: skip

    assert root_cause([failure(named[1], ""), failure(named[0], "")]).rank == 0  # before the stacks
    waiting = 'File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce'
    looping = 'File "/w/train.py", line 9 in fetch'
    blamed = root_cause([failure(named[1], waiting), failure(named[0], looping)])
    assert blamed.rank == 0 and "beats without a new step" in blamed.describe()
    assert "at step 30" in blamed.describe()


def test_progress_timeout_catches_every_rank_beating_one_step_forever():
    limits = dataclasses.replace(FIXED, progress_timeout=20.0)
    watch = HangWatch(limits, started_at=0.0)
    for n, t in enumerate((100.0, 101.0, 110.0, 119.0, 121.0), start=1):
        readings = {0: slot(beats=n, step=30, at=t), 1: slot(beats=n, step=30, at=t + 0.1)}
        watch.observe(readings)
        if t < 120.0:
            assert watch.overdue(t + 0.5, readings) == []
    assert [(o.rank, o.stalled, o.last_step) for o in watch.overdue(121.5, readings)] == [
        (0, True, 30),
        (1, True, 30),
    ]
    assert HangWatch(FIXED, started_at=0.0).stalled(121.5, readings) == []  # off by default


def test_progress_timeout_counts_from_a_new_step_or_a_pause_and_skips_ranks_without_steps():
    limits = dataclasses.replace(FIXED, progress_timeout=20.0)
    watch = HangWatch(limits, started_at=0.0)
    watch.observe({0: slot(beats=1, step=5, at=100.0), 1: slot(beats=1, at=100.0)})
    watch.observe({0: slot(beats=2, step=6, at=115.0), 1: slot(beats=2, at=115.0)})  # a new step
    watch.observe({0: slot(beats=3, step=6, at=118.0, pauses=1), 1: slot(beats=3, at=118.0)})  # saved
    readings = {0: slot(beats=4, step=6, at=125.0, pauses=1), 1: slot(beats=4, at=125.0)}
    watch.observe(readings)
    assert watch.stalled(130.0, readings) == []  # 12 s since the pause ended; rank 1 gives no step
    assert [o.rank for o in watch.stalled(138.5, readings)] == [0]


def test_a_paused_rank_gets_the_init_timeout_from_the_pause_start():
    watch = HangWatch(FIXED, started_at=0.0)
    readings = {0: slot(beats=1, at=10.0), 1: slot(beats=1, at=20.0, paused=True)}
    watch.observe(readings)
    assert [o.rank for o in watch.overdue(30.0, readings)] == [0]  # rank 1 saves for 10 s: fine
    assert {o.rank: o.phase for o in watch.overdue(81.0, readings)} == {0: Phase.STEPPING, 1: Phase.PAUSED}


def test_a_rank_without_its_first_beat_gets_the_init_timeout_once_the_script_beats():
    watch = HangWatch(FIXED, started_at=0.0, known_to_beat=True)  # an earlier attempt beat
    readings = {0: slot(at=0.0), 1: slot(at=30.0)}  # rank 1 ended its init pause at 30 s
    watch.observe(readings)
    assert [(o.rank, o.phase) for o in watch.overdue(61.0, readings)] == [(0, Phase.STARTING)]
    assert [o.rank for o in watch.overdue(91.0, readings)] == [0, 1]


def test_auto_uses_the_init_timeout_until_it_has_learned():
    watch = HangWatch(AUTO, started_at=0.0)
    _beat(watch, interval=0.5, beats=MIN_SAMPLES)  # the first interval is not a sample
    assert watch.step_deadline is None
    _beat(watch, interval=0.5, beats=2, start=MIN_SAMPLES)
    assert watch.step_deadline == pytest.approx(5.0)


def test_auto_has_a_floor_and_follows_slower_steps():
    watch = HangWatch(AUTO, started_at=0.0)
    end = _beat(watch, interval=0.01, beats=50)
    assert watch.step_deadline == 1.0  # 10 x 10 ms is under the floor
    _beat(watch, interval=0.3, beats=5, start=50, t0=end)
    assert watch.step_deadline == pytest.approx(3.0)  # the slower steps reach the p99 at once


def test_auto_ignores_intervals_that_contain_a_pause():
    watch = HangWatch(AUTO, started_at=0.0)
    end = _beat(watch, interval=0.2, beats=30)
    watch.observe({0: slot(beats=31, at=end + 300.0, pauses=1)})  # a 5-minute save in between
    assert watch.step_deadline == pytest.approx(2.0)


def test_a_hung_rank_is_blamed_before_peers_waiting_in_a_collective():
    def hang(rank, step, frame):
        return HangFailure(rank, rank, 100 + rank, Phase.STEPPING, 6.0, 5.0, step, 1.0, stack=(frame,))

    waiting = 'File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce'
    sleeping = 'File "/w/train.py", line 9 in load_batch'
    assert root_cause([hang(0, 9, waiting), hang(1, 9, sleeping), hang(2, 9, waiting)]).rank == 1
    assert root_cause([hang(0, 12, sleeping), hang(1, 9, sleeping)]).rank == 1  # the one behind


def test_a_frozen_process_is_blamed_before_a_peer_that_went_silent_first():
    """Regression (the chaos matrix): rank 0, stopped inside its save, was silent a moment less
    than rank 1, which waited for it in DDP's backward (no torch/distributed frame on top); the
    stopped process is the evidence."""
    backward = 'File "/v/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward'
    waiting = HangFailure(1, 1, 101, Phase.STEPPING, 5.5, 5.0, 20, 100.0, stack=(backward,))
    stopped = HangFailure(0, 0, 100, Phase.PAUSED, 5.4, 60.0, 20, 100.1, process_status="stopped")
    assert root_cause([waiting, stopped]).rank == 0
    asleep = dataclasses.replace(stopped, process_status="sleeping")  # no evidence: the earlier silence
    assert root_cause([waiting, asleep]).rank == 1


def test_stack_dump_is_read_back_per_thread(tmp_path):
    log = tmp_path / "rank_0.log"
    log.write_text(
        "step 1\n"
        "Thread 0x00007f00000000aa (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f00000000bb (most recent call first):\n"
        '  File "/w/train.py", line 37 in sleep_forever\n'
        '  File "/w/train.py", line 80 in <module>\n'
        "[after] more output\n"
    )
    stacks = last_stacks(log)
    assert stacks[0x7F00000000AA] == ('File "/usr/lib/python3.11/threading.py", line 320 in wait',)
    assert (
        stacks[0x7F00000000BB][0] == 'File "/w/train.py", line 37 in sleep_forever'
        and len(stacks[0x7F00000000BB]) == 2
    )
    assert short_frame(stacks[0x7F00000000BB][0]) == "sleep_forever (train.py:37)"
    assert last_stacks(tmp_path / "missing.log") == {}


def test_board_reads_what_a_worker_writes_into_its_slot(monkeypatch):
    import worker_lib.core.progress as hb

    orphan = Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    # as a killed supervisor leaves it: the kernel dropped its lock
    orphan = orphan / f"ftlaunch-heartbeat-owned-{dead_pid()}-0-left"
    orphan.write_bytes(b"")
    board = HeartbeatBoard(3, attempt=0)
    assert not orphan.exists()
    try:
        monkeypatch.setenv(c.FT_HEARTBEAT_FILE, str(board.path))
        monkeypatch.setenv(c.LOCAL_RANK, "2")
        monkeypatch.setattr(hb, "_slot", None)
        hb.heartbeat(41)
        hb.heartbeat(42)
        with hb.pause_heartbeat():
            assert board.read()[2].paused
        reading = board.read()[2]
        assert (reading.beats, reading.step, reading.pauses, reading.paused) == (2, 42, 1, False)
        assert reading.dump_signal == int(hb.STACK_DUMP_SIGNAL) and reading.main_thread and reading.pid
        assert board.read()[0] == BeatReading(0, 0, 0.0, False, 0, 0, 0, 0)  # other slots untouched
    finally:
        board.close()
        hb._slot = None
    assert not board.path.exists()


@pytest.mark.parametrize(
    "text, seconds", [("90", 90.0), ("90s", 90.0), ("1.5m", 90.0), ("2h", 7200.0), ("1d", 86400.0)]
)
def test_durations(text, seconds):
    assert parse_duration(text, "--x") == seconds


@pytest.mark.parametrize("text", ["", "m", "ten", "5w", "-3"])
def test_bad_durations(text):
    with pytest.raises(UsageError, match="--x"):
        parse_duration(text, "--x")


def _beat(watch: HangWatch, interval: float, beats: int, start: int = 0, t0: float = 0.0) -> float:
    """One rank beating every ``interval`` s, read after each beat; returns the last beat time."""
    t = t0
    for n in range(start + 1, start + beats + 1):
        t += interval
        watch.observe({0: slot(beats=n, step=n, at=t)})
    return t


@pytest.mark.parametrize(
    "runner",
    [
        (  # a script forked from the fork server: its zygote's frames, then runpy's (python -m zygote)
            f'  File "{_ZYGOTE}", line 451 in _run_script\n'
            f'  File "{_ZYGOTE}", line 423 in run_main\n'
            f'  File "{_ZYGOTE}", line 506 in main\n'
            f'  File "{_ZYGOTE}", line 513 in <module>\n'
            '  File "<frozen runpy>", line 88 in _run_code\n'
            '  File "<frozen runpy>", line 198 in _run_module_as_main\n'
        ),
        (  # python -m MODULE, plain or forked
            '  File "<frozen runpy>", line 88 in _run_code\n'
            '  File "/usr/lib/python3.11/runpy.py", line 198 in _run_module_as_main\n'
        ),
        "",  # python SCRIPT
    ],
    ids=["forked", "python -m", "python SCRIPT"],
)
def test_a_dump_is_read_from_the_scripts_own_frames_down(tmp_path, runner):
    """What runs the script (the fork server, runpy) is left out below its first frame, as a plain
    `python SCRIPT` dump has nothing below it; the script's own use of runpy, above, stays."""
    log = tmp_path / "rank_0.log"
    log.write_text(
        "Current thread 0x00007f00000000bb (most recent call first):\n"
        '  File "/w/train.py", line 37 in sleep_forever\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
        '  File "/w/train.py", line 80 in <module>\n' + runner + "[after] more output\n"
    )
    assert last_stacks(log)[0x7F00000000BB] == (
        'File "/w/train.py", line 37 in sleep_forever',
        'File "<frozen runpy>", line 88 in _run_code',
        'File "/w/train.py", line 80 in <module>',
    )


def test_a_dump_of_the_runner_alone_is_kept_whole(tmp_path):
    """Stopped before its script ran, a worker's frames are all the runner's: shown as they are."""
    log = tmp_path / "rank_0.log"
    frame = f'  File "{_ZYGOTE}", line 506 in main\n'
    log.write_text("Current thread 0x00000000000000bb (most recent call first):\n" + frame)
    assert last_stacks(log)[0xBB] == (frame.strip(),)
