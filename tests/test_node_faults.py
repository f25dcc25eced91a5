"""Many nodes, faults of a node's supervisor while every rank is inside real DDP collectives
(a script without worker_lib): the job must neither hang nor turn deaf to signals."""

import os
import re
import signal

import pytest
import torch
from helpers import SCRIPTS, frozen_at, run_state, wait_for_files
from test_many_nodes import Job

from launcher.core.events import AttemptPlanned, Decision, NodesMet, PeerInterrupt, Transition

# Several launches (a fault-free run, relaunches), each with its own bounded waits: on a loaded
# machine more than the suite's 120 s. The limit is a hang guard, not a measure of speed.
pytestmark = pytest.mark.timeout(300)

DDP = str(SCRIPTS / "ddp_plain.py")


def _ddp_job(launcher, tmp_path, name, *extra, steps=400, node_timeout="3s", max_failures=3):
    """2 nodes x 1 rank of plain DDP; returned once both ranks have stepped in attempt 0 and the
    script has saved a checkpoint of its own."""
    ready = tmp_path / f"ready_{name}"
    job = Job(
        launcher,
        tmp_path,
        2,
        "--nproc",
        "1",
        "--max-failures",
        str(max_failures),
        "--run-name",
        name,
        *extra,
        DDP,
        "--steps",
        str(steps),
        "--ckpt",
        str(tmp_path / f"{name}.ckpt"),
        "--ready-dir",
        str(ready),
        "--out",
        str(tmp_path / f"{name}.pt"),
        "--until-attempt",
        "1",  # attempt 0 trains until the test's fault stops it: it cannot finish first
        node_timeout=node_timeout,
    ).start_all()
    wait_for_files(ready, "rank_*.attempt_0", 2, timeout=90)
    wait_for_files(tmp_path, f"{name}.ckpt", 1, timeout=60)  # the script's own save: steps to keep
    return job


def _starts(launch) -> list:
    return [int(s) for s in re.findall(r"rank 0 attempt \d+ starts at step (\d+)", launch.stdout)]


def test_a_follower_supervisor_killed_during_ddp_is_no_failure_and_its_relaunch_resumes(launcher, tmp_path):
    """Node 1's ftlaunch is killed -9: its rank dies with it and node 0's rank fails at once in its
    collective. Node 0 must still find node 1 lost, restart, and take the relaunched node in. A
    supervisor's death is not a worker failure: --max-failures 0 holds (issue 33)."""
    job = _ddp_job(launcher, tmp_path, "follower", max_failures=0)
    os.kill(job.nodes[1].proc.pid, signal.SIGKILL)
    job.nodes[1].wait(10)
    assert job.nodes[1].survivors_after(10) == []
    job.nodes[0].wait_for_event(Decision, lambda e: e.verdict == "node_lost", 60)
    job.start(1)
    assert job.wait(180) == {0: 0, 1: 0}, job.nodes[0].stderr
    decided = job.nodes[0].events(Decision)
    assert [d.verdict for d in decided] == ["node_lost"], decided
    assert decided[0].reason.startswith("node 1 ("), decided[0].reason
    state = run_state(tmp_path / "runs" / "follower")
    assert [a.outcome.value for a in state.attempts] == ["NODE_LOST", "SUCCEEDED"]
    assert state.attempts[0].failures[0].cause.value == "node_lost"
    assert "(not a worker failure: not counted)" in job.nodes[0].stderr
    assert job.nodes[0].events(NodesMet)[-1].new_round is True
    starts = _starts(job.nodes[0])
    assert len(starts) == 2 and starts[1] > 0, job.nodes[0].stdout  # the script's own save was used
    assert torch.load(tmp_path / "follower.pt").keys()
    assert job.survivors() == []


def test_node_0_answers_sigterm_while_a_killed_follower_is_being_found_lost(launcher, tmp_path):
    job = _ddp_job(launcher, tmp_path, "deaf", node_timeout="30s")
    os.kill(job.nodes[1].proc.pid, signal.SIGKILL)
    job.nodes[1].wait(10)
    # Node 0's rank has failed in its collective. Node 0 finds node 1's supervisor gone at once (its
    # connection ended; before issue 50 it waited --node-timeout, 30 s, for its report), and meets
    # again: a signal must end the meeting, with no wait for the dead node to read the stop notice.
    job.nodes[0].wait_for_event(Transition, lambda e: e.new == "STOPPED", 60)
    os.kill(job.nodes[0].proc.pid, signal.SIGTERM)
    assert job.nodes[0].wait(20) == 143, job.nodes[0].stderr
    assert "interrupted by SIGTERM" in job.nodes[0].stderr
    assert "to learn of it" not in job.nodes[0].stderr  # a gone node is not waited for
    assert job.survivors() == []


def test_node_0_stopped_past_the_node_timeout_is_waited_for_and_the_job_resumes(launcher, tmp_path):
    """SIGSTOP of node 0's supervisor for longer than --node-timeout: node 1 finds node 0 lost and
    waits for it; once node 0 is continued, both meet again and the job finishes. Node 0 blames its
    own silence, not node 1, and spends no failure on it (--max-failures 0; issue 33)."""
    job = _ddp_job(launcher, tmp_path, "paused", max_failures=0)
    os.kill(job.nodes[0].proc.pid, signal.SIGSTOP)
    try:
        job.nodes[1].wait_for_event(Transition, lambda e: e.new == "STOPPED", 60)
    finally:
        os.kill(job.nodes[0].proc.pid, signal.SIGCONT)
    assert job.wait(180) == {0: 0, 1: 0}, (job.nodes[0].stderr, job.nodes[1].stderr)
    assert "lost node 0" in job.nodes[1].stderr
    # Issue 33.11: the follower dropped its rendezvous handler without a word from Python.
    assert "Traceback" not in job.nodes[1].stderr and "Exception ignored" not in job.nodes[1].stderr
    assert len(_starts(job.nodes[0])) >= 2
    state = run_state(tmp_path / "runs" / "paused")
    assert state.attempts[0].outcome.value == "NODE_LOST", state.attempts[0]
    blamed = state.attempts[0].failures[0]
    assert blamed.node == 0 and "its supervisor did not run for" in blamed.detail, blamed
    # Node 1 left the attempt because node 0 was silent: it is not named lost as well, and
    # nothing needs relaunching (it did, after a 5 s freeze: "node 1 ... lost: no sign of life").
    assert {f.node for f in state.attempts[0].failures} == {0}, state.attempts[0].failures
    assert "must be relaunched" not in job.nodes[0].stderr
    # Node 1 let go of node 0 while it waited, not of its own process: node 0, running again,
    # must not read that as node 1 gone (it did, and said so, before issue 50's fix).
    assert "connection to node 0 closed" not in job.nodes[0].stderr
    assert job.survivors() == []


def test_a_follower_signalled_before_its_ranks_start_stops_every_node_at_once(launcher, tmp_path):
    """SIGTERM reaches node 1 after node 0's plan and before its ranks start (frozen there by a
    failpoint; the signal is delivered when it goes on). Node 1 must tell the other nodes, as it
    does once its ranks run: the job ends PREEMPTED on every node, at once. It did not: node 1
    stopped alone and waited 70 s for a verdict; node 0's rank waited for node 1's in its process
    group, found node 1 lost 15 s after it exited, and waited --join-timeout for it to be
    relaunched."""
    args = [DDP, "--steps", "300", "--step-time", "0.02", "--ckpt", str(tmp_path / "own")]
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--run-name", "gated", *args)
    node0 = job.start(0)
    node1 = job.start(1, env={"FTLAUNCH_FAILPOINT": "planned"})
    frozen_at(node1, "planned")
    assert node1.events(AttemptPlanned) and not [e for e in node1.events(Transition) if e.new == "RUNNING"]
    os.kill(node1.proc.pid, signal.SIGTERM)  # pending while it is stopped
    os.kill(node1.proc.pid, signal.SIGCONT)

    assert job.wait(60) == {0: 143, 1: 143}, (node0.stderr, node1.stderr)
    assert [(e.node, e.kind) for e in node0.events(PeerInterrupt)] == [(1, "stop")]
    state = run_state(tmp_path / "runs" / "gated")
    assert [a.outcome.value for a in state.attempts] == ["PREEMPTED"]
    assert job.survivors() == []
