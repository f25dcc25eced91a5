"""Recovery phases and goodput from scripted event logs and attempts."""

import pytest

from launcher.core.events import CheckpointLoaded, FirstStep, Logged, Transition
from launcher.core.group_state import GroupState as S
from launcher.core.outcomes import AttemptOutcome
from launcher.core.records import AttemptEntry
from launcher.core.recovery import goodput, recoveries


def _t(attempt, new, t, **extra):
    return Logged(Transition(attempt, None, new, **extra), t_mono=t, t_wall=0.0)


def test_each_recovery_is_split_into_phases():
    events = [
        _t(0, S.RUNNING, 1.0),
        _t(0, S.HUNG, 12.0, failed_at=10.0),
        _t(0, S.STOPPING, 12.0),
        _t(0, S.STOPPED, 12.5),
        _t(1, S.STARTING, 12.6),
        _t(1, S.RUNNING, 13.0),
        Logged(CheckpointLoaded(1, t_done=14.0), t_mono=14.1, t_wall=0.0),
        Logged(FirstStep(1), t_mono=15.0, t_wall=0.0),
        _t(1, S.FAILED, 20.0, failed_at=20.0),
        _t(1, S.STOPPED, 20.1),  # the run ended there: no recovery to report
    ]
    (r,) = recoveries(events)
    assert (r.failed, r.detect, r.stop, r.restart, r.load, r.first_step) == (0, 2.0, 0.5, 0.5, 1.0, 1.0)
    assert r.downtime == pytest.approx(5.0)


def _attempt(n, start, end, outcome, resumed=None, newest=None, committed_at=None):
    return AttemptEntry(
        n, start, "host", 1, resumed, end, outcome, newest, committed_at, checkpoints_seen=True
    )


def test_goodput_counts_what_was_kept():
    attempts = [
        _attempt(0, 0.0, 40.0, AttemptOutcome.FAILED, None, 30, 30.0),  # 30 s kept, 10 s lost after it
        _attempt(1, 50.0, 60.0, AttemptOutcome.FAILED, 30, 30, 30.0),  # no progress: all 10 s lost
        _attempt(2, 60.0, 100.0, AttemptOutcome.SUCCEEDED, 30, 50, 99.0),  # all kept
    ]
    assert goodput(attempts, now=100.0) == pytest.approx(0.7)
    attempts[2].first_step_at = 70.0  # its first 10 s were start-up
    assert goodput(attempts, now=100.0) == pytest.approx(0.6)
    assert goodput([], now=1.0) is None


def test_goodput_is_unknown_when_the_script_commits_nothing_ftlaunch_sees():
    attempts = [
        _attempt(0, 0.0, 40.0, AttemptOutcome.FAILED),  # its own checkpoints: kept, or not?
        _attempt(1, 40.0, 100.0, AttemptOutcome.SUCCEEDED),
    ]
    assert goodput(attempts, now=100.0) is None
    attempts[1].beat = True
    assert goodput(attempts[1:], now=100.0) == pytest.approx(1.0)  # nothing failed: all was kept


def test_goodput_is_unknown_when_no_step_was_seen():
    """Issue 48: `--no-python /bin/echo` (no beat, no commit) said 'goodput 100%'. A step seen
    through a beat or a worker_lib commit makes it known."""
    echo = _attempt(0, 0.0, 1.0, AttemptOutcome.SUCCEEDED)
    assert goodput([echo], now=1.0) is None
    committing = _attempt(0, 0.0, 10.0, AttemptOutcome.SUCCEEDED, None, 5, 9.0)
    assert goodput([committing], now=10.0) == pytest.approx(1.0)
