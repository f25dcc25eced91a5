"""The metrics as the events make them (launcher.observe.metrics): scripted event logs, read back
at chosen moments. The exporter's port and file, and a real Prometheus, are tested with real runs
(tests/test_metrics.py)."""

import math
import os
import stat
from pathlib import Path

import pytest

from launcher.core.beats import BeatReading, CheckpointCounters, Phase
from launcher.core.config import MetricsSection
from launcher.core.events import (
    AttemptEnded,
    AttemptPlanned,
    CheckpointLoaded,
    CheckpointTotals,
    EventLog,
    FirstStep,
    Hang,
    KeptTime,
    Laggard,
    Logged,
    Steps,
    Transition,
)
from launcher.core.group_state import GroupState
from launcher.grammar.errors import UsageError
from launcher.observe.families import families
from launcher.observe.metrics import RunMetrics
from launcher.observe.slots import SlotObserver, checkpoint_totals
from worker_lib.core import contract as c


def _at(event, t: float) -> Logged:
    """An event logged at monotonic ``t`` and wall ``1000 + t``."""
    return Logged(event, t, 1000.0 + t)


def _values(metrics: RunMetrics, now: float) -> dict:
    """name → value, or name → {label value: value} for families with a label of their own."""
    found = {}
    for family in families(metrics, now, 1000.0 + now):
        if len(family.samples) == 1 and not family.samples[0][0]:
            found[family.name] = family.samples[0][1]
        else:
            found[family.name] = {labels[0][1]: value for labels, value in family.samples}
    return found


def _attempt(number: int, t: float, *, fails_at: float = None, hung: bool = False):
    """An attempt's transitions: started at t, running at t + 1, failed (or hung) and stopped."""
    yield _at(Transition(number, None, GroupState.STARTING), t)
    yield _at(Transition(number, GroupState.STARTING, GroupState.RUNNING), t + 1)
    if fails_at is not None:
        state = GroupState.HUNG if hung else GroupState.FAILED
        yield _at(Transition(number, GroupState.RUNNING, state, failed_at=fails_at - 0.5), fails_at)
        yield _at(Transition(number, state, GroupState.STOPPING), fails_at)
        yield _at(Transition(number, GroupState.STOPPING, GroupState.STOPPED), fails_at + 1)


def _folded(*logged) -> RunMetrics:
    metrics = RunMetrics()
    for e in logged:
        metrics.fold(e)
    return metrics


def test_a_fresh_node_knows_nothing_yet_and_says_so():
    values = _values(RunMetrics(), 5.0)
    assert values["ftlaunch_attempts"] == 0
    assert values["ftlaunch_attempt"] == -1
    assert values["ftlaunch_failures"] == {"crash": 0, "hang": 0, "lost_node": 0, "unknown": 0}
    for unknown in (
        "ftlaunch_goodput_ratio",
        "ftlaunch_step",
        "ftlaunch_step_age_seconds",
        "ftlaunch_world_size",
    ):
        assert math.isnan(values[unknown]), unknown
    assert values["ftlaunch_checkpoint_save_seconds"] == {"memory": (0.0, 0.0), "storage": (0.0, 0.0)}


def test_failures_by_kind_restarts_preemptions_resizes_and_hangs_come_from_the_attempts_ends():
    metrics = _folded(
        *_attempt(0, 0.0, fails_at=10.0),
        _at(AttemptEnded(0, "FAILED", "crash", rank=1, restarting=True), 11.5),
        *_attempt(1, 12.0, fails_at=30.0, hung=True),
        _at(Hang(1, 0, Phase.STEPPING, 6.0, 5.0, 17, 24.0), 30.0),
        _at(Laggard(1, 1, Phase.STEPPING, 3.0, 5.0, 17, 27.0), 29.0),
        _at(AttemptEnded(1, "FAILED", "hang", rank=0, restarting=True), 31.5),
        *_attempt(2, 32.0),
        _at(AttemptEnded(2, "RESIZED", restarting=True), 40.0),
        *_attempt(3, 41.0),
        _at(AttemptEnded(3, "FAILED", "lost_node", rank=-1, node=2, restarting=False), 50.0),
        _at(AttemptEnded(4, "PREEMPTED"), 60.0),
        _at(AttemptEnded(5, "FAILED", "something new"), 61.0),
    )
    values = _values(metrics, 62.0)
    assert values["ftlaunch_failures"] == {"crash": 1, "hang": 1, "lost_node": 1, "unknown": 1}
    assert values["ftlaunch_restarts"] == 3
    assert values["ftlaunch_resizes"] == 1
    assert values["ftlaunch_preemptions"] == 1
    assert values["ftlaunch_hangs_detected"] == 1  # a laggard is not a hang
    assert values["ftlaunch_attempts"] == 4 and values["ftlaunch_attempt"] == 3


def test_downtime_sums_each_recovery_from_the_failure_to_the_next_first_step():
    metrics = _folded(
        *_attempt(0, 0.0, fails_at=10.0),  # failed at 9.5, seen at 10, stopped at 11
        *_attempt(1, 12.0),  # running at 13
        _at(CheckpointLoaded(1, t_done=13.5, step=40, tier="memory"), 13.6),
        _at(FirstStep(1), 14.0),
    )
    assert _values(metrics, 20.0)["ftlaunch_downtime_seconds"] == 14.0 - 9.5


def test_the_group_runs_between_running_and_its_end():
    metrics = _folded(*_attempt(0, 0.0))
    assert _values(metrics, 2.0)["ftlaunch_group_running"] == 1.0
    metrics.fold(_at(Transition(0, GroupState.RUNNING, GroupState.SUCCEEDED), 5.0))
    assert _values(metrics, 6.0)["ftlaunch_group_running"] == 0.0


def test_the_step_its_age_and_the_pace_come_from_the_steps_events():
    metrics = _folded(
        *_attempt(0, 0.0),
        _at(Steps(0, step=10, furthest=11, reported_at=4.0), 4.1),
        _at(Steps(0, step=60, furthest=60, reported_at=9.0), 9.1),
    )
    values = _values(metrics, 10.0)
    assert values["ftlaunch_step"] == 60
    assert values["ftlaunch_step_age_seconds"] == 1.0
    assert values["ftlaunch_steps_per_second"] == 10.0
    # No new reading for longer than the last two were apart: the step stalled, the pace falls.
    assert _values(metrics, 19.0)["ftlaunch_steps_per_second"] == 5.0
    # A new attempt starts with no pace and the last step it knows; a group not running has none.
    metrics.fold(_at(Transition(0, GroupState.RUNNING, GroupState.FAILED), 20.0))
    assert math.isnan(_values(metrics, 21.0)["ftlaunch_steps_per_second"])
    metrics.fold(_at(Transition(1, None, GroupState.STARTING), 22.0))
    metrics.fold(_at(Transition(1, GroupState.STARTING, GroupState.RUNNING), 23.0))
    values = _values(metrics, 23.5)  # the newest step known is the last attempt's, until this one's
    assert (values["ftlaunch_step"], values["ftlaunch_step_age_seconds"]) == (60, 14.5)
    metrics.fold(_at(Steps(1, step=50, furthest=50, reported_at=24.0), 24.1))
    values = _values(metrics, 25.0)
    assert values["ftlaunch_step"] == 50 and math.isnan(values["ftlaunch_steps_per_second"])


def test_a_finished_group_has_no_pace_never_a_pace_of_0():
    """Issue 48: the final --metrics-file of a 3-step run said 0.0 steps per second."""
    metrics = _folded(
        *_attempt(0, 0.0),
        _at(Steps(0, step=1, furthest=1, reported_at=2.0), 2.1),
        _at(Steps(0, step=2, furthest=2, reported_at=3.0), 3.1),
        _at(Transition(0, GroupState.RUNNING, GroupState.SUCCEEDED), 3.5),
    )
    values = _values(metrics, 4.0)
    assert values["ftlaunch_step"] == 2 and math.isnan(values["ftlaunch_steps_per_second"])


def test_goodput_counts_the_attempt_in_progress_from_its_first_step_as_the_run_record_does():
    metrics = _folded(
        _at(KeptTime(seconds=None, since=1000.0, in_progress=True), 0.0),
    )
    assert math.isnan(_values(metrics, 10.0)["ftlaunch_goodput_ratio"])  # unknown stays unknown
    metrics = _folded(
        _at(KeptTime(seconds=30.0, since=1000.0, in_progress=False), 50.0),  # 30 s kept of 50
        _at(KeptTime(seconds=30.0, since=1000.0, in_progress=True), 52.0),  # attempt 1 starts
        *_attempt(1, 52.0),
    )
    metrics.fold(_at(FirstStep(1), 60.0))
    assert _values(metrics, 100.0)["ftlaunch_goodput_ratio"] == (30.0 + 40.0) / 100.0
    metrics.fold(_at(KeptTime(seconds=55.0, since=1000.0, in_progress=False), 110.0))
    assert _values(metrics, 110.0)["ftlaunch_goodput_ratio"] == 0.5


def test_world_size_nodes_and_checkpoints_by_tier_sum_every_attempts_newest_totals():
    metrics = _folded(
        _at(AttemptPlanned(0, world_size=4, nodes=[0, 1], ranks=[0, 1]), 0.0),
        _at(CheckpointTotals(0, saves_memory=2, save_memory_s=0.5), 1.0),
        _at(CheckpointTotals(0, saves_memory=4, save_memory_s=1.0, commits=1, commit_s=2.0), 2.0),
        _at(AttemptPlanned(1, world_size=2, nodes=[0], ranks=[0, 1]), 3.0),
        _at(
            CheckpointTotals(1, saves_storage=2, save_storage_s=0.25, loads_memory=2, load_memory_s=0.1), 4.0
        ),
    )
    values = _values(metrics, 5.0)
    assert (values["ftlaunch_world_size"], values["ftlaunch_nodes"]) == (2, 1)
    assert values["ftlaunch_checkpoint_save_seconds"] == {"memory": (4.0, 1.0), "storage": (2.0, 0.25)}
    assert values["ftlaunch_checkpoint_commit_seconds"] == (1.0, 2.0)
    assert values["ftlaunch_checkpoint_load_seconds"] == {"memory": (2.0, 0.1), "storage": (0.0, 0.0)}


def _reading(step: int, active_at: float, beats: int = 1, tier: int = c.LOADED_NONE, loaded_at: float = 0.0):
    return BeatReading(beats, step, active_at, False, 0, 0, 0, 123, loaded_at=loaded_at, loaded_tier=tier)


def test_the_slots_become_steps_events_when_every_rank_has_beaten_and_at_most_every_few_seconds(tmp_path):
    with EventLog(tmp_path / "events.jsonl") as log:
        observer = SlotObserver(log, 3)
        none = lambda: {}  # noqa: E731
        observer.look(1.0, {0: _reading(5, 0.9), 1: _reading(-1, 0.0, beats=0)}, [0, 1], none)
        observer.look(1.1, {0: _reading(6, 1.0), 1: _reading(4, 1.05)}, [0, 1], none)
        observer.look(2.0, {0: _reading(9, 1.9), 1: _reading(8, 1.95)}, [0, 1], none)  # not due yet
        observer.look(7.0, {0: _reading(30, 6.9), 1: _reading(29, 6.95)}, [0, 1], none)
        observer.final({0: _reading(33, 7.5), 1: _reading(31, 7.4)}, {})
        steps = [e.event for e in log.logged if isinstance(e.event, Steps)]
    assert steps == [Steps(3, 4, 6, 1.05), Steps(3, 29, 30, 6.95), Steps(3, 31, 33, 7.4)]


def test_checkpoint_counters_are_summed_over_the_ranks_and_loads_go_under_each_ranks_tier():
    counters = {
        0: CheckpointCounters(
            saves_memory=3, save_memory_ns=3_000_000, commits=1, commit_ns=2_000_000_000, load_ns=10**8
        ),
        1: CheckpointCounters(
            saves_memory=3,
            save_memory_ns=1_000_000,
            saves_storage=1,
            save_storage_ns=5 * 10**8,
            load_ns=3 * 10**8,
        ),
    }
    slots = {
        0: _reading(1, 1.0, tier=c.LOADED_MEMORY, loaded_at=0.5),
        1: _reading(1, 1.0, tier=c.LOADED_STORAGE, loaded_at=0.6),
    }
    totals = checkpoint_totals(2, counters, slots)
    assert totals == CheckpointTotals(
        2,
        saves_memory=6,
        save_memory_s=0.004,
        saves_storage=1,
        save_storage_s=0.5,
        commits=1,
        commit_s=2.0,
        loads_memory=1,
        load_memory_s=0.1,
        loads_storage=1,
        load_storage_s=0.3,
    )


def test_the_metrics_section_refuses_a_port_out_of_range_and_a_folder_for_a_file(tmp_path):
    for bad, said in (
        (dict(port=65536), "--metrics-port must be in 0..65535, got 65536"),
        (dict(port=-1), "--metrics-port must be in 0..65535"),
        (dict(file=tmp_path), "--metrics-file must name a file"),
    ):
        with pytest.raises(UsageError, match=said):
            MetricsSection(**bad)
    assert MetricsSection(port=0, file=tmp_path / "m.prom").port == 0


def test_the_metrics_section_refuses_a_path_that_a_rename_would_replace(tmp_path):
    """Each write renames a new file over the path: a device, a FIFO or a symlink there would be
    replaced for everyone (`--metrics-file /dev/null` as root made /dev/null a regular file)."""
    fifo, link, regular = tmp_path / "m.fifo", tmp_path / "link.prom", tmp_path / "m.prom"
    os.mkfifo(fifo)
    regular.write_text("")
    link.symlink_to(regular)
    for bad in (fifo, link, Path(os.devnull)):
        with pytest.raises(UsageError, match="--metrics-file must be a regular file"):
            MetricsSection(file=bad)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    assert MetricsSection(file=regular).file == regular  # a regular file is replaced, as before


def test_goodput_before_any_step_is_not_a_run_that_kept_all_its_time():
    """The run opens (the in-progress KeptTime), its first attempt starts, and for 60 s no rank
    has stepped (imports, data, the fork server's start): nothing was spent on steps yet, and a
    script that never beats may never show a step (issue 48: it read 0%, a number for unknown)."""
    metrics = _folded(
        _at(KeptTime(seconds=0.0, since=1000.0, in_progress=True), 0.0),
        *_attempt(0, 1.0),
    )
    assert math.isnan(_values(metrics, 60.0)["ftlaunch_goodput_ratio"])
    metrics.fold(_at(FirstStep(0), 60.0))
    assert _values(metrics, 100.0)["ftlaunch_goodput_ratio"] == 0.4  # 40 s stepping of 100


def test_after_an_attempts_first_minute_steps_and_totals_are_written_seldom(tmp_path):
    """The run dir's events.jsonl holds every event: a long attempt adds few lines to it."""
    with EventLog(tmp_path / "events.jsonl") as log:
        observer = SlotObserver(log, 0)
        for t in (0.0, 2.0, 5.5, 61.0, 70.0, 76.5, 100.0, 131.0):
            saves = int(t) + 1  # a memory snapshot every second: the counters always change
            observer.look(
                t,
                {0: _reading(int(t) + 1, t)},
                [0],
                lambda saves=saves: {0: CheckpointCounters(saves_memory=saves)},
            )
        steps = [e.event.reported_at for e in log.logged if isinstance(e.event, Steps)]
        totals = [e.event.saves_memory for e in log.logged if isinstance(e.event, CheckpointTotals)]
    assert steps == [0.0, 5.5, 61.0, 76.5, 100.0, 131.0]  # every 5 s, then every 15 s
    assert totals == [1, 6, 62, 132]  # every 5 s, then every 60 s
