"""A fixed-size job never trains on fewer nodes than asked (issue 39). A follower's supervisor is
killed -9 at each moment of the nodes' meeting (frozen there by a failpoint, so the moment is
exact, not a race) and relaunched at once, or late (once node 0 has acted on its silence): every
attempt runs on both nodes, every rank sees WORLD_SIZE 2, and the job ends with both nodes'
result."""

import os
import re
import signal

import pytest
from helpers import ACTOR, SCRIPTS, frozen_at, run_state
from test_many_nodes import Job

from launcher.core.events import Decision, NodesMet, RoundAbandoned, WorkerExit

# Several launches (a fault-free run, relaunches), each with its own bounded waits: on a loaded
# machine more than the suite's 120 s. The limit is a hang guard, not a measure of speed.
pytestmark = pytest.mark.timeout(300)

DDP = str(SCRIPTS / "ddp_plain.py")


def _node0_acted(node0, point: str) -> None:
    """Evidence that node 0 has acted on the frozen follower, whatever the moment: still waiting
    for it to join a round (it says so), gave the round up, or ended the attempt it was lost in."""
    if point == "before-round":
        node0.read_console_until(lambda line: "waiting for all 2 nodes to join" in line, 60, stream="stderr")
    elif point == "round-joined":
        node0.wait_for_event(RoundAbandoned, timeout=60)
    else:
        node0.wait_for_event(Decision, timeout=60)


def _world_sizes(stdout: str) -> set:
    return {int(w) for w in re.findall(r"has WORLD_SIZE (\d+)", stdout)}


@pytest.mark.parametrize("relaunch", ["at-once", "late"])
@pytest.mark.parametrize("point", ["before-round", "round-joined", "announced"])
def test_a_follower_killed_while_nodes_meet_never_shrinks_a_fixed_job(launcher, tmp_path, point, relaunch):
    out = tmp_path / "out.pt"
    script = [DDP, "--steps", "30", "--step-time", "0.02", "--ckpt", str(tmp_path / "own"), "--out", str(out)]
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--max-failures", "3", "--run-name", "fixed", *script)
    node0 = job.start(0)
    frozen = job.start(1, env={"FTLAUNCH_FAILPOINT": point})
    frozen_at(frozen, point)
    if relaunch == "late":
        _node0_acted(node0, point)
    os.kill(frozen.proc.pid, signal.SIGKILL)
    frozen.wait(30)
    assert frozen.survivors_after(10) == []
    follower = job.start(1)

    codes = {0: node0.wait(240), 1: follower.wait(240)}
    assert codes == {0: 0, 1: 0}, (node0.stderr, follower.stderr)
    # Every attempt node 0 planned ran on both nodes, and every rank of every attempt saw it.
    met = node0.events(NodesMet)
    assert met and all(e.nodes == [0, 1] for e in met), met
    assert _world_sizes(node0.stdout) == {2} and _world_sizes(follower.stdout) == {2}
    state = run_state(tmp_path / "runs" / "fixed")
    assert state.status.value == "SUCCEEDED"
    assert all(a.world_size == 2 and [n["node"] for n in a.nodes] == [0, 1] for a in state.attempts)
    assert out.exists() and "rank 1 attempt" in follower.stdout
    assert job.survivors() == []


@pytest.mark.exec_workers  # the meeting is the subject: torch-free ranks, started plainly
@pytest.mark.parametrize("point", ["claimed", "before-round"])
def test_node_0_killed_while_a_follower_meets_is_waited_for_and_rejoined(launcher, tmp_path, point):
    """docs/many-nodes.md: a dead node 0 is waited for, up to --join-timeout, at any moment. Node 1
    is frozen after it claimed its rank in node 0's store (before it opens the rendezvous), or
    just before it joins a round; node 0 is killed -9 there, and node 1 goes on against its dead
    store. At "claimed" it exited 70: c10d's rendezvous backend, made then, found the connection
    reset (RendezvousConnectionError), which nothing took for node 0's loss (the chaos matrix's
    leader-kill, seed 52891)."""
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--run-name", "rejoin", str(ACTOR), "--run-for", "0")
    node0 = job.start(0)
    node1 = job.start(1, env={"FTLAUNCH_FAILPOINT": point})
    frozen_at(node1, point)
    os.kill(node0.proc.pid, signal.SIGKILL)
    node0.wait(30)
    assert node0.survivors_after(10) == []
    os.kill(node1.proc.pid, signal.SIGCONT)
    node1.read_console_until(lambda line: "lost node 0" in line, 60, stream="stderr")

    job.start(0)
    frozen_at(node1, point)  # the failpoint again, on its way back in: let it go on
    os.kill(node1.proc.pid, signal.SIGCONT)
    codes = job.wait(120)
    assert codes == {0: 0, 1: 0}, (job.nodes[0].stderr, node1.stderr)
    assert "Traceback" not in node1.stderr and "internal error" not in node1.stderr
    state = run_state(tmp_path / "runs" / "rejoin")
    assert state.status.value == "SUCCEEDED" and [a.world_size for a in state.attempts] == [2]
    assert job.survivors() == []


@pytest.mark.parametrize("signalled", [0, 1])
def test_a_signal_on_one_node_while_the_nodes_meet_stops_every_node(launcher, tmp_path, signalled):
    """docs/many-nodes.md: SIGTERM on any node stops every node. While the nodes meet there is no
    attempt's channel to carry it: the stop goes through node 0's store (the lobby), where every
    node looks while it waits. Node 1 is held at the moment before its round (a failpoint), node 0 waits for
    it; one of them gets SIGTERM. Before, only that node stopped and the other waited out
    --join-timeout."""
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--run-name", "met", DDP, node_timeout="30s")
    node0 = job.start(0)
    node1 = job.start(1, env={"FTLAUNCH_FAILPOINT": "before-round"})
    frozen_at(node1, "before-round")
    node0.read_console_until(lambda line: "waiting for all 2 nodes to join" in line, 60, stream="stderr")
    os.kill(job.nodes[signalled].proc.pid, signal.SIGTERM)
    os.kill(node1.proc.pid, signal.SIGCONT)

    codes = job.wait(60)
    assert codes == {0: 143, 1: 143}, (node0.stderr, node1.stderr)
    other = 1 - signalled
    assert "interrupted by SIGTERM while the nodes were meeting" in job.nodes[signalled].stderr
    said = f"interrupted by SIGTERM on node {signalled} while the nodes were meeting"
    assert said in job.nodes[other].stderr
    state = run_state(tmp_path / "runs" / "met")
    assert state.status.value == "PREEMPTED" and state.attempts == []
    assert "worker" not in node0.stdout + node1.stdout  # no rank ever started
    assert job.survivors() == []


def test_a_signal_on_a_node_whose_ranks_are_done_stops_every_node_as_a_preemption(launcher, tmp_path):
    """Node 1's rank exited 0 and node 1 waits for node 0's verdict while node 0's rank still runs.
    A SIGTERM there is a preemption of the job (every node exits 143, nothing counted), not node
    1 leaving the attempt, which node 0 counted as a failure and restarted without it."""
    actor = [str(SCRIPTS / "actor.py"), "--sleeper", "0", "--run-for", "0"]
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--run-name", "done", *actor)
    job.start_all()
    job.nodes[1].wait_for_event(WorkerExit, lambda e: e.rank == 1 and e.exitcode == 0, timeout=120)
    os.kill(job.nodes[1].proc.pid, signal.SIGTERM)

    codes = job.wait(120)
    assert codes == {0: 143, 1: 143}, (job.nodes[0].stderr, job.nodes[1].stderr)
    state = run_state(tmp_path / "runs" / "done")
    assert state.status.value == "PREEMPTED", state.reason
    assert [a.outcome for a in state.attempts] == ["PREEMPTED"] and state.attempts[0].failures == []
    assert "left the attempt" not in job.nodes[0].stderr
    assert job.survivors() == []
