"""--chaos's faults of a node (kill-node, bad-node) without processes: the grammar and its
refusals, the configuration's check of node=, and when each fires on the node it names (scripted
clocks and heartbeat slots)."""

import signal

import pytest

from launcher.chaos.injector import ChaosInjector, mark_injected
from launcher.core.beats import BeatReading
from launcher.core.config import LaunchConfig
from launcher.core.failures import ProcessFailure
from launcher.grammar.chaos import FaultKind, TriggerKind, parse_chaos
from launcher.grammar.errors import UsageError


def slot(step=-1, beats=0):
    return BeatReading(beats, step, 0.0, False, 0, 0, 0, 100)


def test_node_faults_parse_and_print_back():
    plan = parse_chaos("kill-node:node=2,at=7.5s;bad-node:node=1,at=step:3,times=4;seed=5", 1)
    lost, bad = plan.faults
    assert (lost.kind, lost.node, lost.rank, lost.times) == (FaultKind.KILL_NODE, 2, None, 1)
    assert (lost.trigger.kind, lost.trigger.at) == (TriggerKind.TIME, 7.5)
    assert (bad.kind, bad.node, bad.times, bad.trigger.kind, bad.trigger.at) == (
        FaultKind.BAD_NODE,
        1,
        4,
        TriggerKind.STEP,
        3,
    )
    assert str(plan) == "kill-node:node=2,at=7.5s;bad-node:node=1,at=step:3,times=4;seed=5"
    assert parse_chaos(str(plan), 99) == plan
    every = parse_chaos("bad-node:node=3,at=1s", 1).faults[0]
    assert every.times is None and str(every) == "bad-node:node=3,at=1s"  # every attempt, by default


@pytest.mark.parametrize(
    "spec, says",
    [
        ("kill-node:node=0,at=5s", "cannot name node 0: it leads"),
        ("bad-node:node=0,at=step:3", "cannot name node 0: it leads"),
        ("kill-node:at=5s", "needs node=N"),
        ("bad-node:node=-1,at=1s", "0 or more"),
        ("kill-node:node=two,at=1s", "whole number"),
        ("kill-node:node=1", "needs at=DURATION or at=step:N"),
        ("kill-node:node=1,rank=2,at=1s", "names a node (node=), not a rank"),
        ("bad-node:node=1,every=10s", "takes at="),
        ("bad-node:node=1,at=1s,jitter=1s", "takes at="),
        ("kill-node:node=1,at=save", "not at=save"),
        ("bad-node:node=1,at=commit", "not at=commit"),
        ("kill-node:node=1,at=1s,times=2", "once and for good: no times="),
        ("bad-node:node=1,at=1s,times=0", "1 or more"),
        ("kill:node=1,at=1s", "node= goes with kill-node and bad-node"),
        ("kill-node:node=1,node=2,at=1s", "node= given twice"),
    ],
)
def test_a_bad_node_fault_is_one_clear_usage_error(spec, says):
    with pytest.raises(UsageError, match="--chaos") as err:
        parse_chaos(spec, default_seed=1)
    assert says in str(err.value) and "\n" not in str(err.value)


def _config(spec: str, nnodes: int, standby: int = 0) -> LaunchConfig:
    cluster = dict(nnodes=nnodes, standby=standby, rdzv_endpoint="127.0.0.1:29400") if nnodes > 1 else {}
    flat = {**cluster, "entrypoint": "train.py", "chaos": parse_chaos(spec, 1)}
    return LaunchConfig.of(**flat)


def test_the_named_node_must_be_one_of_the_jobs_nodes_standbys_included():
    assert _config("kill-node:node=3,at=1s", 3, standby=1).cluster.members == 4
    with pytest.raises(UsageError, match=r"names node 4, outside 1\.\.3 \(--nnodes 3 \+ --standby-nodes 1\)"):
        _config("kill-node:node=4,at=1s", 3, standby=1)
    with pytest.raises(UsageError, match=r"bad-node names node 3, outside 1\.\.2 \(--nnodes 3\)$"):
        _config("bad-node:node=3,at=1s", 3)
    with pytest.raises(UsageError, match="kill-node needs a job of many nodes"):
        _config("kill-node:node=1,at=1s", 1)


def test_kill_node_fires_once_on_the_named_node_alone_counted_from_the_start():
    plan = parse_chaos("kill-node:node=1,at=10s", 1)
    named = ChaosInjector(plan, 2, {1}, started=100.0, node=1)
    other = ChaosInjector(plan, 2, {0}, started=100.0, node=0)
    assert named.look(109.9, {1: 11}, {}) == [] and other.look(110.0, {0: 10}, {}) == []
    (fault,) = named.look(110.0, {1: 11}, {})
    assert (fault.kind, fault.rank, fault.signum) == ("kill-node", -1, signal.SIGKILL)
    named.attempt_started()
    assert named.look(200.0, {1: 21}, {}) == []  # once: the node is gone


def test_kill_node_waits_for_running_ranks_and_a_step_of_any_of_them():
    plan = parse_chaos("kill-node:node=2,at=step:5", 1)
    injector = ChaosInjector(plan, 4, {4, 5}, started=0.0, node=2)
    assert injector.look(50.0, {}, {}) == []  # standing by or between attempts: no ranks run
    assert injector.look(51.0, {4: 1, 5: 2}, {4: slot(4, 4), 5: slot()}) == []
    (fault,) = injector.look(52.0, {4: 1, 5: 2}, {4: slot(4, 5), 5: slot(5, 6)})
    assert fault.kind == "kill-node"


def test_bad_node_kills_every_rank_of_the_node_in_every_attempt_after_its_start():
    plan = parse_chaos("bad-node:node=1,at=2s", 1)
    injector = ChaosInjector(plan, 4, {2, 3}, started=0.0, node=1)
    fired = []
    for attempt, begin in enumerate((30.0, 100.0, 300.0)):
        injector.attempt_started()
        running = {2: 10 * attempt + 2, 3: 10 * attempt + 3}
        for tick in range(0, 40):
            t = begin + tick / 10
            fired += [(attempt, round(t - begin, 1), f.rank, f.pid) for f in injector.look(t, running, {})]
    assert fired == [(a, 2.0, r, 10 * a + r) for a in range(3) for r in (2, 3)]  # each attempt, once


def test_bad_node_at_a_step_and_times_caps_the_attempts():
    injector = ChaosInjector(parse_chaos("bad-node:node=1,at=step:3,times=2", 1), 2, {1}, 0.0, node=1)
    for attempt in range(3):
        injector.attempt_started()
        assert injector.look(10.0 * attempt, {1: attempt}, {1: slot(2, 3)}) == []
        due = injector.look(10.0 * attempt + 1, {1: attempt}, {1: slot(3, 4)})
        assert [(f.kind, f.rank, f.pid) for f in due] == ([("bad-node", 1, attempt)] if attempt < 2 else [])


def test_a_bad_nodes_kill_marks_its_ranks_failure_injected():
    injector = ChaosInjector(parse_chaos("bad-node:node=1,at=0s", 1), 2, {1}, 0.0, node=1)
    (sent,) = injector.look(1.0, {1: 77}, {})
    died = ProcessFailure(1, 0, 77, -signal.SIGKILL, 1.0)
    assert mark_injected([died], [sent])[0].injected


def test_node_faults_leave_the_rank_faults_draws_as_they_were():
    def ranks(spec):
        injector = ChaosInjector(parse_chaos(spec, 1), 8, set(range(8)), 0.0, node=0)
        return [f.rank for t in range(0, 100) for f in injector.look(float(t), {r: r for r in range(8)}, {})]

    alone = ranks("kill:every=10s;seed=3")
    assert ranks("bad-node:node=1,at=1s;kill:every=10s;seed=3") == alone
    assert len(set(alone)) > 1


def test_with_standby_nodes_a_rank_fault_follows_the_rank_to_the_node_that_takes_its_place(tmp_path):
    """Node 3 stands by, then takes position 1: --chaos naming rank 1 fires there (node 3 warmed up
    as the last position, rank 2); without standby nodes a node's ranks are its own, whatever the
    attempt."""
    from launcher.chaos.driver import chaos_for
    from launcher.core.events import EventLog
    from launcher.core.layout import Layout

    plan = parse_chaos("kill:rank=1,at=step:5", default_seed=1)
    said = []
    events = EventLog(tmp_path / "events.jsonl")
    driver = chaos_for(plan, Layout.every_node(3, 3, 1), events, said.append, positions=True)
    driver.attempt_started(Layout((0, 1, 2), 3, 1, standby=(3,)))
    took = Layout((0, 3, 2), 3, 1)
    driver.attempt_started(took)
    due = driver._injector.look(1.0, {1: 4242}, {1: slot(step=5, beats=6)})
    assert [(i.rank, i.pid) for i in due] == [(1, 4242)]
    fixed = chaos_for(plan, Layout.every_node(3, 1, 1), events, said.append)
    fixed.attempt_started(Layout((0, 2, 1), 1, 1))  # another place: its ranks stay node 1's
    assert [i.rank for i in fixed._injector.look(1.0, {1: 7}, {1: slot(step=5, beats=6)})] == [1]
    events.close()
