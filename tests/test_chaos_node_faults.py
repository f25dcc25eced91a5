"""--chaos's faults of a node on real loopback nodes, each once and short: kill-node (the named
node's whole tree SIGKILLed, for good; a standby takes its place) and bad-node (the named node's
ranks killed in every attempt; without a standby the budget is spent as for any crash)."""

import pytest
from helpers import SCRIPTS, memory_folders, run_state
from test_many_nodes import Job
from test_standby import _start

from launcher.core.events import ChaosInjected, Decision, NodeReplaced, NodesMet
from launcher.core.outcomes import AttemptOutcome

# Three supervisors and their workers on two cores; the limit is a hang guard, not a measure of speed.
pytestmark = pytest.mark.timeout(300)

TRAIN = str(SCRIPTS / "ckpt_train.py")


def test_kill_node_loses_the_named_nodes_whole_tree_and_a_standby_takes_its_place(launcher, tmp_path):
    out = tmp_path / "out.pt"
    spec = "kill-node:node=1,at=step:12"
    args = ["--steps", "40", "--step-time", "0.05", "--save-every", "10", "--until-attempt", "1"]
    ours = ["--standby-nodes", "1", "--nproc", "1", "--max-failures", "0", "--run-name", "lost"]
    job = Job(launcher, tmp_path, 2, *ours, "--chaos", spec, TRAIN, *args, "--out", str(out))
    node0 = _start(job, members=3).nodes[0]
    lost = job.nodes[1]

    # The named node killed itself, workers, fork server and orphan guard with it: nothing to
    # clean up after it, no memory tier left in /dev/shm, and no line after the chaos line.
    assert lost.wait(180) == -9, lost.stderr
    assert lost.survivors_after(5.0) == [] and memory_folders(lost.proc.pid) == []
    (injected,) = lost.events(ChaosInjected)
    assert (injected.fault, injected.rank, injected.pid) == (spec, -1, lost.proc.pid), injected
    assert injected.step is not None and injected.step >= 12, injected
    assert "] chaos: this node is lost for good at step 1" in lost.stderr.rstrip().splitlines()[-1]

    # Replaced at once by the standby, with its position; no failure (--max-failures 0 held).
    replaced = node0.wait_for_event(NodesMet, lambda e: e.attempt == 1, timeout=120)
    assert replaced.nodes == [0, 2] and not replaced.new_round, replaced
    codes = {rank: job.nodes[rank].wait(180) for rank in (0, 2)}
    assert codes == {0: 0, 2: 0}, node0.stderr
    (event,) = node0.events(NodeReplaced)
    assert (event.position, event.node, event.replaced) == (1, 2, 1), event
    assert [d.verdict for d in node0.events(Decision)] == ["replace"]
    assert "rank 1 attempt 1 has WORLD_SIZE 2" in job.nodes[2].stdout
    assert not job.nodes[2].events(ChaosInjected)  # the fault named node 1, not its position
    state = run_state(tmp_path / "runs" / "lost")
    assert [a.outcome for a in state.attempts] == [AttemptOutcome.NODE_LOST, AttemptOutcome.SUCCEEDED]
    assert out.exists() and job.survivors() == []


def test_bad_node_crashes_the_named_nodes_ranks_in_every_attempt_until_the_budget_is_spent(
    launcher, tmp_path
):
    """Without a standby, nothing replaces the node: each attempt's root cause is its rank, marked
    injected, and with --chaos-counts the budget is spent (exit 1), as for any crash (two
    attempts: --crash-loop's three would come after)."""
    spec = "bad-node:node=1,at=step:2"
    ours = ["--nproc", "1", "--max-failures", "1", "--chaos-counts", "--run-name", "bad"]
    args = ["--steps", "400", "--step-time", "0.05", "--out", str(tmp_path / "out.pt")]
    job = Job(launcher, tmp_path, 2, *ours, "--chaos", spec, TRAIN, *args)
    job.start_all()
    assert job.wait(240) == {0: 1, 1: 1}, job.nodes[0].stderr
    sent = job.nodes[1].events(ChaosInjected)
    assert [(e.attempt, e.rank, e.signal, e.fault) for e in sent] == [
        (a, 1, "SIGKILL", spec) for a in range(2)
    ]
    assert all(e.step is not None and e.step >= 2 for e in sent), sent
    assert not job.nodes[0].events(ChaosInjected)
    state = run_state(tmp_path / "runs" / "bad")
    assert [a.outcome for a in state.attempts] == [AttemptOutcome.FAILED] * 2
    assert all(a.injected for a in state.attempts), state.attempts
    causes = [f for a in state.attempts for f in a.failures if f.injected]
    assert [(f.rank, f.node) for f in causes] == [(1, 1)] * 2, causes
    assert job.survivors() == []


def test_bad_node_with_a_standby_is_excluded_and_the_standby_trains_in_its_place(launcher, tmp_path):
    """--exclude-after's default with a standby (2): node 1, blamed for its two injected crashes,
    exits 8 and the standby takes GROUP_RANK 1; injected failures spend no budget (--max-failures 0)."""
    out = tmp_path / "out.pt"
    spec = "bad-node:node=1,at=step:3"
    args = ["--steps", "30", "--step-time", "0.05", "--save-every", "10", "--out", str(out)]
    ours = ["--standby-nodes", "1", "--nproc", "1", "--max-failures", "0", "--run-name", "excluded"]
    job = Job(launcher, tmp_path, 2, *ours, "--chaos", spec, TRAIN, *args)
    node0 = _start(job, members=3).nodes[0]
    codes = job.wait(240)
    assert codes == {0: 0, 1: 8, 2: 0}, (node0.stderr, job.nodes[1].stderr)
    assert "this node is excluded: node 1 (" in job.nodes[1].stderr
    assert [e.attempt for e in job.nodes[1].events(ChaosInjected)] == [0, 1]
    assert not job.nodes[2].events(ChaosInjected)  # in node 1's place, not node 1
    state = run_state(tmp_path / "runs" / "excluded")
    outcomes = [(a.outcome, a.blamed_node, a.injected) for a in state.attempts]
    assert outcomes == [
        (AttemptOutcome.FAILED, 1, True),
        (AttemptOutcome.FAILED, 1, True),
        (AttemptOutcome.SUCCEEDED, None, False),
    ], outcomes
    assert state.attempts[2].replaced.startswith(
        "node 2 took node 1's place (GROUP_RANK 1, RANK 1): excluded"
    )
    assert "rank 1 attempt 2 has WORLD_SIZE 2" in job.nodes[2].stdout
    assert out.exists() and job.survivors() == []
