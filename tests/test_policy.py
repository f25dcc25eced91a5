"""The restart policy with scripted histories and clocks: budget, window, backoff, crash loop."""

import pytest

from launcher.outcomes import AttemptOutcome
from launcher.policy import AttemptRecord, RestartPolicy, Verdict

F, P, L = AttemptOutcome.FAILED, AttemptOutcome.PREEMPTED, AttemptOutcome.SUPERVISOR_LOST


def history(*failures, outcome=F, progressed=None):
    """Attempts that ended at the given times (seconds), each as ``outcome``."""
    return [AttemptRecord(i, outcome, t, progressed) for i, t in enumerate(failures)]


@pytest.mark.parametrize(
    "max_failures, failures, restart",
    [(0, 1, False), (1, 1, True), (1, 2, False), (3, 3, True), (3, 4, False), (-1, 1000, True)],
)
def test_failure_budget(max_failures, failures, restart):
    policy = RestartPolicy(max_failures=max_failures, crash_loop=0)
    decision = policy.after_failure(history(*range(failures)), now=failures)
    assert decision.restart is restart
    assert decision.verdict is (Verdict.RESTART if restart else Verdict.BUDGET_SPENT)


def test_only_failures_inside_the_window_count():
    policy = RestartPolicy(max_failures=2, failure_window=600.0, crash_loop=0)
    spread = history(0.0, 500.0, 1000.0, 1500.0)  # never more than 2 within 10 minutes
    assert policy.after_failure(spread, now=1500.0).restart
    assert policy.counted_failures(spread, now=1500.0) == 2
    burst = history(0.0, 1300.0, 1400.0, 1500.0)
    decision = policy.after_failure(burst, now=1500.0)
    assert not decision.restart and "3 failures in the last 600 s" in decision.reason


def test_backoff_doubles_per_failure_without_progress_and_is_capped():
    policy = RestartPolicy(max_failures=-1, crash_loop=0, backoff=1.0, backoff_cap=10.0)
    delays = [policy.after_failure(history(*range(n)), now=n).delay for n in range(1, 8)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_progress_resets_the_backoff():
    policy = RestartPolicy(max_failures=-1, crash_loop=0, backoff=1.0)
    made_progress = [
        AttemptRecord(0, F, 0.0, False),
        AttemptRecord(1, F, 1.0, False),
        AttemptRecord(2, F, 2.0, True),
    ]
    assert policy.after_failure(made_progress, now=2.0).delay == 0.0


def test_crash_loop_needs_known_lack_of_progress_in_a_row():
    policy = RestartPolicy(max_failures=-1, crash_loop=3)
    stuck = history(0.0, 1.0, 2.0, progressed=False)
    decision = policy.after_failure(stuck, now=2.0)
    assert decision.verdict is Verdict.CRASH_LOOP and "3 attempts in a row" in decision.reason
    assert policy.after_failure(stuck[:2], now=1.0).restart
    unknown = history(0.0, 1.0, 2.0, progressed=None)  # no checkpoints seen: never a crash loop
    assert policy.after_failure(unknown, now=2.0).restart
    broken = stuck[:1] + [AttemptRecord(1, F, 1.0, True)] + stuck[2:]
    assert policy.after_failure(broken, now=2.0).restart


def test_preemptions_and_lost_supervisors_do_not_count_as_failures():
    policy = RestartPolicy(max_failures=1, crash_loop=2)
    mixed = [
        AttemptRecord(0, P, 0.0),
        AttemptRecord(1, L, 1.0, False),
        AttemptRecord(2, F, 2.0, False),
        AttemptRecord(3, L, 3.0, False),
        AttemptRecord(4, P, 4.0),
    ]
    assert policy.counted_failures(mixed, now=5.0) == 1
    assert (
        policy.after_failure(mixed + [AttemptRecord(5, F, 5.0, True)], now=5.0).verdict
        is Verdict.BUDGET_SPENT
    )
    # a lost supervisor neither ends nor extends a row of failures without progress
    row = [AttemptRecord(0, F, 0.0, False), AttemptRecord(1, L, 1.0), AttemptRecord(2, F, 2.0, False)]
    assert (
        RestartPolicy(max_failures=-1, crash_loop=2).after_failure(row, now=2.0).verdict is Verdict.CRASH_LOOP
    )
