"""Many nodes, faults of a node's supervisor while every rank is inside real DDP collectives
(a script without worker_lib): the job must neither hang nor turn deaf to signals."""

import os
import re
import signal

import torch
from helpers import SCRIPTS, wait_for_files
from test_many_nodes import Job

from launcher.events import Decision, NodesMet, Transition

DDP = str(SCRIPTS / "ddp_plain.py")


def _ddp_job(launcher, tmp_path, name, *extra, steps=400, node_timeout="3s"):
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
        "3",
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


def test_a_follower_supervisor_killed_during_ddp_is_a_failure_and_its_relaunch_resumes(launcher, tmp_path):
    """Node 1's ftlaunch is killed -9: its rank dies with it and node 0's rank fails at once in its
    collective. Node 0 must still find node 1 lost, restart, and take the relaunched node in."""
    job = _ddp_job(launcher, tmp_path, "follower")
    os.kill(job.nodes[1].proc.pid, signal.SIGKILL)
    job.nodes[1].wait(10)
    assert job.nodes[1].survivors_after(10) == []
    job.nodes[0].wait_for_event(Decision, lambda e: e.verdict == "RESTART", 60)
    job.start(1)
    assert job.wait(180) == {0: 0, 1: 0}, job.nodes[0].stderr
    failed = [e for e in job.nodes[0].events(Decision)]
    assert len(failed) == 1, failed
    assert job.nodes[0].events(NodesMet)[-1].new_round is True
    starts = _starts(job.nodes[0])
    assert len(starts) == 2 and starts[1] > 0, job.nodes[0].stdout  # the script's own save was used
    assert torch.load(tmp_path / "follower.pt").keys()
    assert job.survivors() == []


def test_node_0_answers_sigterm_while_a_killed_follower_is_being_found_lost(launcher, tmp_path):
    job = _ddp_job(launcher, tmp_path, "deaf", node_timeout="30s")
    os.kill(job.nodes[1].proc.pid, signal.SIGKILL)
    job.nodes[1].wait(10)
    # Node 0's rank has failed in its collective; node 1 is not lost yet (30 s): node 0 waits for
    # its report. A signal must end that wait.
    job.nodes[0].wait_for_event(Transition, lambda e: e.new == "STOPPED", 60)
    os.kill(job.nodes[0].proc.pid, signal.SIGTERM)
    assert job.nodes[0].wait(20) == 143, job.nodes[0].stderr
    assert "interrupted by SIGTERM" in job.nodes[0].stderr
    assert job.survivors() == []


def test_node_0_stopped_past_the_node_timeout_is_waited_for_and_the_job_resumes(launcher, tmp_path):
    """SIGSTOP of node 0's supervisor for longer than --node-timeout: node 1 finds node 0 lost and
    waits for it; once node 0 is continued, both meet again and the job finishes."""
    job = _ddp_job(launcher, tmp_path, "paused")
    os.kill(job.nodes[0].proc.pid, signal.SIGSTOP)
    try:
        job.nodes[1].wait_for_event(Transition, lambda e: e.new == "STOPPED", 60)
    finally:
        os.kill(job.nodes[0].proc.pid, signal.SIGCONT)
    assert job.wait(180) == {0: 0, 1: 0}, (job.nodes[0].stderr, job.nodes[1].stderr)
    assert "lost node 0" in job.nodes[1].stderr
    assert len(_starts(job.nodes[0])) >= 2
    assert job.survivors() == []
