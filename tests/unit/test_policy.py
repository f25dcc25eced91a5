"""The restart policy with scripted histories and clocks: budget, window, backoff, crash loop."""

import pytest

from launcher.core.evidence import Progress, ProgressEvidence, judge_progress
from launcher.core.outcomes import AttemptOutcome
from launcher.core.policy import AttemptRecord, RestartPolicy, Verdict

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
    stuck = [policy.after_failure(history(*range(n), progressed=False), now=n).delay for n in range(1, 8)]
    assert stuck == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    unknown = [policy.after_failure(history(*range(n)), now=n).delay for n in range(1, 8)]
    assert unknown == [0.0] * 7  # no evidence of being stuck: restart at once, as torchrun does


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
    unknown = history(0.0, 1.0, 2.0, progressed=None)  # no evidence either way: never a crash loop
    assert policy.after_failure(unknown, now=2.0).restart
    broken = [*stuck[:2], AttemptRecord(2, F, 2.0, None), AttemptRecord(3, F, 3.0, False)]
    assert policy.after_failure(broken, now=3.0).restart  # an unknown attempt ends the row
    broken = stuck[:1] + [AttemptRecord(1, F, 1.0, True)] + stuck[2:]
    assert policy.after_failure(broken, now=2.0).restart


def _evidence(**seen):
    base = dict(
        commits_seen=True,
        committed_before=None,
        committed_after=None,
        beat=False,
        furthest_step=None,
        beat_before=False,
        furthest_before=None,
        lived=30.0,
    )
    return ProgressEvidence(**{**base, **seen})


@pytest.mark.parametrize(
    "seen, verdict",
    [
        (dict(committed_before=10, committed_after=20), Progress.MADE),  # a newer commit
        (dict(beat=True, furthest_step=17, furthest_before=12), Progress.MADE),  # further than ever
        (dict(beat=True, furthest_step=12, furthest_before=17), Progress.NONE),  # not as far as before
        (dict(beat=True, furthest_step=5), Progress.MADE),  # the first attempt that beats
        (dict(beat_before=True), Progress.NONE),  # the script beats, this attempt never did
        (dict(committed_before=10, committed_after=10), Progress.NONE),  # the script commits; not now
        (dict(lived=0.2), Progress.NONE),  # failed at once
        (dict(), Progress.UNKNOWN),  # its own checkpoints, no beats: nothing to judge by
        (dict(commits_seen=False, committed_before=10), Progress.UNKNOWN),  # storage unreadable
        (dict(beat=True), Progress.UNKNOWN),  # beats without steps tell liveness, not progress
    ],
)
def test_progress_is_judged_from_evidence_only(seen, verdict):
    judged, words = judge_progress(_evidence(**seen))
    assert judged is verdict and words


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


def test_a_change_of_an_elastic_jobs_nodes_neither_counts_nor_ends_a_crash_loop():
    """Issue 25.4: a RESIZED attempt (a node lost or joining) is no failure; the failures around it
    are counted as if it were not there."""
    resized = AttemptOutcome.RESIZED
    stalled = [
        AttemptRecord(0, F, 0.0, False),
        AttemptRecord(1, resized, 1.0, False),
        AttemptRecord(2, resized, 2.0, None),
        AttemptRecord(3, F, 3.0, False),
    ]
    policy = RestartPolicy(max_failures=2, crash_loop=2)
    assert policy.counted_failures(stalled, now=3.0) == 2
    assert policy.after_failure(stalled, now=3.0).verdict is Verdict.CRASH_LOOP
    assert RestartPolicy(max_failures=1, crash_loop=0).after_failure(stalled[1:], 4.0).restart


def test_a_lost_node_of_a_fixed_job_neither_counts_nor_ends_a_crash_loop():
    """Issue 33.4: a node's supervisor that died or froze (NODE_LOST) is no worker failure."""
    lost = AttemptOutcome.NODE_LOST
    history = [AttemptRecord(i, lost, float(i), False) for i in range(5)]
    assert RestartPolicy(max_failures=0).counted_failures(history, now=5.0) == 0
    row = [
        AttemptRecord(0, F, 0.0, False),
        AttemptRecord(1, lost, 1.0, False),
        AttemptRecord(2, F, 2.0, False),
    ]
    assert (
        RestartPolicy(max_failures=-1, crash_loop=2).after_failure(row, now=2.0).verdict is Verdict.CRASH_LOOP
    )


# (--max-failures, failures before this one) that a run can reach: a spent budget ended it
_REACHABLE = [(m, b) for m in (-1, 0, 1, 3) for b in (0, 1, 3) if m < 0 or b <= m]


@pytest.mark.parametrize("max_failures, before", _REACHABLE)
@pytest.mark.parametrize("injectable, count_injected", [(False, False), (True, False), (True, True)])
def test_a_failure_may_be_restarted_as_the_decision_after_it_would_restart(
    max_failures, before, injectable, count_injected
):
    """Asked as the group stops (the next ranks are forked ahead only then): a budget with no room
    (--max-failures 0, or spent) says no; a failure --chaos may have caused, not counted, says yes
    as long as the run goes on; the answer is the decision's once the failure is in the history."""
    policy = RestartPolicy(max_failures=max_failures, crash_loop=0, count_injected=count_injected)
    finished = history(*range(before))
    after = [*finished, AttemptRecord(before, F, float(before), injected=injectable)]
    decided = policy.after_failure(after, now=before).restart
    assert policy.may_restart_a_failure(finished, now=before, injectable=injectable) is decided


def test_with_max_failures_0_no_failure_may_be_restarted_unless_chaos_caused_it():
    policy = RestartPolicy(max_failures=0)
    assert not policy.may_restart_a_failure([], now=0.0, injectable=False)
    assert policy.may_restart_a_failure([], now=0.0, injectable=True)  # --chaos without --chaos-counts
