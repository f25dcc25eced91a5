"""Stragglers' parts that start no process: a step's own work from beats and the flight recorder's
entry times, the window over a rank's counters, and the judge across the job's ranks."""

import pytest

from launcher.core.beats import OwnWork, ProgressRow
from launcher.hangs.stragglers import OwnWorkWindow, StragglerJudge, own_work_ratios
from worker_lib.core.own_work import step_own_work


def test_a_steps_own_work_runs_from_its_start_to_the_last_collective_it_entered():
    beats = [1000, 2000, 3000, 4000]
    entered = [1100, 1700, 2300, 3950]  # step 1: two buckets; step 2: one; step 3: one late
    assert step_own_work(beats, entered, None) == [(700, 1000), (300, 1000), (950, 1000)]


def test_a_step_with_no_collective_is_not_measured_never_zero():
    assert step_own_work([1000, 2000, 3000], [2500], None) == [(500, 1000)]
    assert step_own_work([1000, 2000], [], None) == []


def test_a_step_older_than_the_recorders_oldest_entry_is_passed_over():
    """The ring dropped that step's early entries: its last one may be all that is left, or not."""
    assert step_own_work([1000, 2000, 3000], [1900, 2500], oldest_kept=1900) == [(500, 1000)]


def _window(samples, window=10.0):
    own = OwnWorkWindow(window)
    for t, counters in samples:
        own.observe(t, lambda c=counters: c)
    return own


def test_the_window_gives_the_mean_own_work_a_step_over_its_last_seconds():
    samples = [(float(t), {0: OwnWork(steps=10 * t, own_ns=10 * t * 50_000_000)}) for t in range(0, 21)]
    # the last 10 s at 0.1 s a step instead
    samples += [
        (float(t), {0: OwnWork(steps=200 + 10 * (t - 20), own_ns=10**10 + (t - 20) * 10**9)})
        for t in range(21, 32)
    ]
    own = _window(samples)
    assert own.figure(0) == pytest.approx(0.1)


def test_no_figure_until_half_the_window_and_a_few_steps():
    assert _window([(0.0, {0: OwnWork()}), (4.0, {0: OwnWork(40, 10**9)})]).figure(0) is None  # 4 s of 10
    assert _window([(0.0, {0: OwnWork()}), (6.0, {0: OwnWork(2, 10**9)})]).figure(0) is None  # 2 steps
    assert _window([(0.0, {0: OwnWork()}), (6.0, {0: OwnWork(4, 10**9)})]).figure(0) == pytest.approx(0.25)
    assert _window([(0.0, {0: OwnWork()}), (6.0, {0: OwnWork()})]).figures() == {}  # never measured


def _rows(**own):
    return [
        ProgressRow(int(r[1:]), 100 + int(r[1:]), 5, 0.1, "stepping", node=int(r[1:]) // 2, own_work=v)
        for r, v in own.items()
    ]


def test_each_rank_is_compared_with_the_median_of_the_others():
    ratios = own_work_ratios(_rows(r0=0.1, r1=0.1, r2=0.1, r3=0.2))
    assert ratios == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0})  # the slow one is no one's median
    assert own_work_ratios(_rows(r0=0.1, r1=None)) == {}  # one measured rank has no peers


def test_a_slow_rank_is_named_once_and_said_back_once():
    judge = StragglerJudge(1.5)
    (named,) = judge.judge(_rows(r0=0.1, r1=0.1, r2=0.1, r3=0.19))
    assert (named.rank, named.node, named.back) == (3, 1, False) and named.ratio == pytest.approx(1.9)
    assert judge.judge(_rows(r0=0.1, r1=0.1, r2=0.1, r3=0.2)) == []  # still slow: said once
    assert judge.judge(_rows(r0=0.1, r1=0.1, r2=0.1, r3=None)) == []  # unknown is not back
    (back,) = judge.judge(_rows(r0=0.1, r1=0.1, r2=0.1, r3=0.11))
    assert (back.rank, back.back) == (3, True)


def test_a_balanced_job_names_no_one():
    judge = StragglerJudge(1.5)
    assert judge.judge(_rows(r0=0.1, r1=0.12, r2=0.09, r3=0.14)) == []


def test_a_node_with_every_rank_slow_names_each_of_them():
    judge = StragglerJudge(1.5)
    named = judge.judge(_rows(r0=0.1, r1=0.1, r2=0.1, r3=0.1, r4=0.2, r5=0.2))
    assert [(s.rank, s.node) for s in named] == [(4, 2), (5, 2)]
