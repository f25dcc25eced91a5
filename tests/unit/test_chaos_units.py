"""--chaos without processes: the SPEC grammar, when each fault fires (scripted clocks and
heartbeat slots), and how injected failures count."""

import signal

import pytest

from launcher.chaos.injector import ChaosInjector, mark_injected, not_landed
from launcher.core.beats import BeatReading
from launcher.core.failures import ProcessFailure
from launcher.core.outcomes import AttemptOutcome
from launcher.core.policy import AttemptRecord, RestartPolicy, Verdict
from launcher.grammar.chaos import FaultKind, TriggerKind, parse_chaos
from launcher.grammar.errors import UsageError
from worker_lib.core import contract as c


def slot(step=-1, beats=0, pid=100):
    return BeatReading(beats, step, 0.0, False, 0, 0, 0, pid)


def test_the_documented_example_parses_and_prints_back():
    plan = parse_chaos("kill:rank=random,every=30s,jitter=10s;hang:at=step:500;seed=7", default_seed=1)
    assert plan.seed == 7
    kill, hang = plan.faults
    assert (kill.kind, kill.rank, kill.times) == (FaultKind.KILL, None, None)
    assert (kill.trigger.kind, kill.trigger.at, kill.trigger.jitter) == (TriggerKind.EVERY, 30.0, 10.0)
    assert (hang.kind, hang.trigger.kind, hang.trigger.at, hang.times) == (
        FaultKind.HANG,
        TriggerKind.STEP,
        500,
        1,
    )
    assert hang.kind.signum == signal.SIGSTOP
    assert parse_chaos(str(plan), default_seed=99) == plan  # the printed plan replays the run


def test_without_a_seed_the_default_is_used():
    plan = parse_chaos("segv:rank=1,at=1.5m,times=2", default_seed=1234)
    assert plan.seed == 1234 and plan.faults[0].trigger.at == 90.0 and plan.faults[0].times == 2


@pytest.mark.parametrize(
    "spec, says",
    [
        ("", "at least one fault"),
        (";;", "at least one fault"),
        ("seed=3", "no fault"),
        ("boom:at=1s", "unknown fault 'boom'"),
        ("kill", "exactly one of at= and every="),
        ("kill:at=1s,every=2s", "exactly one of at= and every="),
        ("kill:at=1s,at=2s", "at= given twice"),
        ("kill:at=1s,jitter=1s", "jitter= goes with every="),
        ("kill:every=1s,jitter=2s", "more than jitter="),
        ("kill:every=0", "more than 0"),
        ("kill:at=nan", "takes a duration"),
        ("kill:at=inf", "takes a duration"),
        ("kill:at=-5s", "must not be negative"),
        ("kill:at=step:x", "whole number"),
        ("kill:at=step:-1", "0 or more"),
        ("kill:rank=-1,at=1s", "0 or more"),
        ("kill:rank=one,at=1s", "whole number"),
        ("kill:at=1s,times=0", "1 or more"),
        ("kill:at=1s,color=red", "is not rank="),
        ("kill:at", "is not rank="),
        ("kill:at=1s;seed=x", "whole number"),
    ],
)
def test_a_bad_spec_is_one_clear_usage_error(spec, says):
    with pytest.raises(UsageError, match="--chaos") as err:
        parse_chaos(spec, default_seed=1)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_rank_outside_the_world_is_refused():
    plan = parse_chaos("kill:rank=4,at=1s", default_seed=1)
    plan.check_ranks(5)
    with pytest.raises(UsageError, match="rank 4, outside 0..3"):
        plan.check_ranks(4)


def test_at_a_time_fires_once_counted_from_the_start():
    injector = ChaosInjector(parse_chaos("kill:rank=1,at=10s", 1), 2, {0, 1}, started=100.0)
    running = {0: 10, 1: 11}
    assert injector.look(109.9, running, {}) == []
    (fault,) = injector.look(110.0, running, {})
    assert (fault.rank, fault.pid, fault.signum, fault.kind) == (1, 11, signal.SIGKILL, "kill")
    assert injector.look(200.0, {0: 20, 1: 21}, {}) == []  # once


def test_every_counts_only_time_with_workers_running():
    injector = ChaosInjector(parse_chaos("segv:rank=0,every=10s", 1), 1, {0}, started=0.0)
    fired = []
    for t in range(0, 26):  # 25 s of running, one look a second
        fired += [t for _ in injector.look(float(t), {0: 5}, {})]
    assert fired == [10, 20]
    injector.attempt_started()  # 100 s with the group down count for nothing
    later = [t for t in range(125, 131) for _ in injector.look(float(t), {0: 6}, {})]
    assert later == [130]  # 25 s before, 5 s since: 30


def test_jitter_stays_within_its_bounds_and_the_seed_replays_the_same_run():
    def firings(seed):
        plan = parse_chaos(f"kill:every=10s,jitter=4s;seed={seed}", default_seed=0)
        injector = ChaosInjector(plan, 8, set(range(8)), started=0.0)
        out = []
        for tick in range(0, 2000):
            t = tick / 10
            out += [(t, f.rank) for f in injector.look(t, {r: 100 + r for r in range(8)}, {})]
        return out

    a, b, c = firings(3), firings(3), firings(4)
    assert a == b and a != c
    gaps = [later[0] - earlier[0] for earlier, later in zip(a, a[1:])]
    assert all(6.0 - 0.11 <= g <= 14.0 + 0.11 for g in gaps), gaps
    assert len({rank for _, rank in a}) > 1  # random ranks


def test_at_a_step_waits_for_the_ranks_heartbeat():
    injector = ChaosInjector(parse_chaos("hang:rank=1,at=step:50", 1), 2, {0, 1}, started=0.0)
    running = {0: 10, 1: 11}
    assert injector.look(1.0, running, {1: slot()}) == []  # no beat yet: step unknown
    assert injector.look(2.0, running, {1: slot(step=49, beats=49)}) == []
    (fault,) = injector.look(3.0, running, {1: slot(step=50, beats=50)})
    assert fault.signum == signal.SIGSTOP


def test_worker_side_faults_are_requests_in_the_slot_for_worker_lib():
    plan = parse_chaos("kill:rank=0,at=save;segv:rank=0,at=commit;raise:rank=0,at=1s;sleep:rank=0,at=2s", 1)
    injector = ChaosInjector(plan, 1, {0}, started=0.0)
    first = injector.look(0.5, {0: 10}, {})  # save and commit points: asked at once, done at the save
    assert [(f.kind, f.signum) for f in first] == [("kill", signal.SIGKILL), ("segv", signal.SIGSEGV)]
    words = [f.request for f in first] + [f.request for f in injector.look(2.0, {0: 10}, {})]
    decoded = [(w >> 16, (w >> 8) & 0xFF, w & 0xFF) for w in words]
    assert decoded == [
        (1, c.CHAOS_AT_SAVE, signal.SIGKILL),
        (2, c.CHAOS_AT_COMMIT, signal.SIGSEGV),
        (3, c.CHAOS_AT_BEAT, c.CHAOS_RAISE),
        (4, c.CHAOS_AT_BEAT, c.CHAOS_SLEEP),
    ]
    signals = ChaosInjector(parse_chaos("kill:rank=0,at=1s", 1), 1, {0}, started=0.0)
    assert [f.request for f in signals.look(1.0, {0: 10}, {})] == [0]  # the supervisor's own signal


def test_a_request_its_rank_never_carried_out_is_asked_again_until_it_lands():
    plan = parse_chaos("segv:rank=random,at=commit;seed=3", 1)
    injector = ChaosInjector(plan, 4, {0, 1, 2, 3}, started=0.0)
    running = {r: 100 + r for r in range(4)}
    (asked,) = injector.look(0.1, running, {})
    # The rank was stopped (a peer's failure) before its commit: its failure is not the fault's.
    stopped = ProcessFailure(asked.rank, asked.rank, asked.pid, -signal.SIGTERM, 1.0)
    marked = mark_injected([stopped], [asked])
    assert not_landed(marked, [asked]) == [asked]
    injector.ask_again(asked)
    injector.attempt_started()
    (again,) = injector.look(2.0, {r: 200 + r for r in range(4)}, {})
    assert (again.fault, again.rank) == (asked.fault, asked.rank)
    # Carried out this time (the rank died of it): landed, and never asked for again.
    died = ProcessFailure(again.rank, again.rank, again.pid, -signal.SIGSEGV, 3.0)
    assert not_landed(mark_injected([died], [again]), [again]) == []
    assert injector.look(4.0, {r: 200 + r for r in range(4)}, {}) == []


def test_an_exception_or_a_sleep_cannot_wait_for_a_save():
    for spec in ("raise:at=save", "sleep:at=commit"):
        with pytest.raises(UsageError, match="kill, segv or hang can"):
            parse_chaos(spec, 1)


def test_a_rank_on_another_node_is_left_to_that_node_but_the_plan_moves_on_alike():
    plan = parse_chaos("kill:every=5s;seed=11", default_seed=0)
    node0 = ChaosInjector(plan, 4, {0, 1}, started=0.0)
    node1 = ChaosInjector(plan, 4, {2, 3}, started=0.0)
    hits = {0: [], 1: []}
    for tick in range(0, 320):  # 32 s
        t = tick / 10
        hits[0] += [f.rank for f in node0.look(t, {0: 1, 1: 2}, {})]
        hits[1] += [f.rank for f in node1.look(t, {2: 3, 3: 4}, {})]
    assert all(r in (0, 1) for r in hits[0]) and all(r in (2, 3) for r in hits[1])
    assert len(hits[0]) + len(hits[1]) == 6  # one fault every 5 s for the job, not one per node


def test_a_rank_that_already_exited_gets_nothing():
    injector = ChaosInjector(parse_chaos("kill:rank=1,at=0s", 1), 2, {0, 1}, started=0.0)
    assert injector.look(1.0, {0: 10}, {}) == []
    assert len(injector.look(2.0, {0: 12, 1: 13}, {})) == 1


def test_injected_failures_do_not_count_unless_asked():
    injected = [AttemptRecord(i, AttemptOutcome.FAILED, float(i), False, injected=True) for i in range(5)]
    decision = RestartPolicy(max_failures=1, crash_loop=2).after_failure(injected, now=5.0)
    assert decision.verdict is Verdict.RESTART and decision.delay == 0.0
    assert "injected failure, not counted" in decision.reason
    counted = RestartPolicy(max_failures=1, crash_loop=0, count_injected=True).after_failure(
        injected, now=5.0
    )
    assert counted.verdict is Verdict.BUDGET_SPENT
    # A real failure after injected ones still counts, and they neither end nor extend its crash loop.
    real = AttemptRecord(5, AttemptOutcome.FAILED, 5.0, False)
    assert RestartPolicy(max_failures=0, crash_loop=0).after_failure([*injected, real], 6.0).verdict is (
        Verdict.BUDGET_SPENT
    )
    stalled = [real, *injected, AttemptRecord(6, AttemptOutcome.FAILED, 6.0, False)]
    assert (
        RestartPolicy(max_failures=-1, crash_loop=2).after_failure(stalled, 7.0).verdict is Verdict.CRASH_LOOP
    )


def test_an_injected_failure_is_the_root_cause_over_a_peer_that_looks_more_guilty():
    """Found by the matrix: a rank asked to sleep and its peer (blocked in DDP's backward, one
    beat earlier) were both hung; the peer was blamed and the attempt counted as a real failure."""
    from launcher.core.beats import Phase
    from launcher.core.failures import HangFailure, root_cause

    peer = HangFailure(0, 0, 10, Phase.STEPPING, 3.0, 3.0, 78, observed_at=1.0)
    asleep = HangFailure(1, 1, 11, Phase.STEPPING, 3.0, 3.0, 78, observed_at=1.1, injected=True)
    assert root_cause([peer, asleep]) is asleep


def test_a_stop_half_way_through_a_part_happens_once_however_many_chunks_follow():
    """Found by the matrix: a rank stopped half-way through its part (SIGSTOP) and continued by
    the supervisor's stop stopped itself again at its next chunk, so SIGTERM found it stopped and
    the group was only killed when the grace period ran out. Here the action is a signal whose
    handler counts it."""
    import io

    from worker_lib.core.chaos import dying_half_way

    received = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: received.append(signum))
    try:
        fill = dying_half_way(lambda out: [out.write(b"x" * 10) for _ in range(5)], signal.SIGUSR2)
        fill(io.BytesIO())
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert received == [signal.SIGUSR2]


def test_a_slow_rank_is_a_request_carrying_its_factor_and_never_a_failure_not_landed():
    plan = parse_chaos("slow:rank=1,at=step:50,factor=2.5", 1)
    assert str(plan.faults[0]) == "slow:rank=1,at=step:50,factor=2.5"
    injector = ChaosInjector(plan, 2, {0, 1}, started=0.0)
    (asked,) = injector.look(1.0, {0: 10, 1: 11}, {1: slot(step=50, beats=50)})
    word = asked.request
    assert (word >> c.CHAOS_FACTOR_SHIFT, (word >> 16) & 0xFFFF, (word >> 8) & 0xFF, word & 0xFF) == (
        250,
        1,
        c.CHAOS_AT_BEAT,
        c.CHAOS_SLOW,
    )
    assert not_landed([], [asked]) == []  # it fails nothing by design: never "did not land"
    assert parse_chaos("slow:rank=0,at=1s", 1).faults[0].factor == 2.0  # the default


@pytest.mark.parametrize("factor", ["1", "0.5", "101", "nan", "inf", "fast", ""])
def test_a_slow_factor_outside_1_to_100_is_refused(factor):
    with pytest.raises(UsageError, match="factor= must be a number more than 1 and at most 100"):
        parse_chaos(f"slow:rank=0,at=1s,factor={factor}", 1)


def test_a_factor_goes_with_slow_only():
    with pytest.raises(UsageError, match="factor= goes with slow"):
        parse_chaos("kill:rank=0,at=1s,factor=2", 1)
