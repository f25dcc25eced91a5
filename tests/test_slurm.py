"""scripts/ftlaunch_sbatch.sh on a real SLURM cluster on this machine (munge, slurmctld and three
slurmd on 127.0.0.1, see slurm_cluster.py): srun starts one ftlaunch per node with no many-node
options, a crash restarts both, a preemption notice stops every rank at one step, the job requeues
itself and the requeued job resumes from that step. With a standby node, a node that exits 8
(unhealthy) is named for draining and is never the job's verdict: node 0's code is."""

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest
from helpers import MARKER, ROOT, SCRIPTS, processes_with_marker, wait_for_files
from slurm_cluster import one_cluster_at_a_time, start_cluster, why_not_here

WRAPPER = str(ROOT / "scripts" / "ftlaunch_sbatch.sh")
BEATER = str(SCRIPTS / "beater.py")
FTLAUNCH = Path(sys.executable).parent / "ftlaunch"  # the console script `make install` puts there
# The first test also pays for the cluster's start (and, on a fresh machine, for apt): more than
# the suite's default per-test limit.
# One cluster per module, in one test worker: two would fight over /etc/hosts and slurmstepd.
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("slurm")]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@pytest.fixture(scope="module")
def slurm():
    reason = why_not_here()
    if reason:
        pytest.skip(reason)
    with one_cluster_at_a_time():
        cluster = start_cluster()
        yield cluster
        cluster.stop()


class BatchJob:
    def __init__(self, slurm, tmp_path: Path, *args: str, nodes: int = 2, env: Optional[dict] = None) -> None:
        self.slurm, self.marker = slurm, uuid.uuid4().hex
        self.out, self.runs = tmp_path / "job.out", tmp_path / "runs"
        env = {
            **os.environ,
            **slurm.env,
            MARKER: self.marker,  # sbatch passes the environment on: every process of the job has it
            "GLOO_SOCKET_IFNAME": "lo",
            "FTLAUNCH_BIN": str(FTLAUNCH),
            "FTLAUNCH_RUN_DIR": str(self.runs),
            **(env or {}),
        }
        argv = ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={self.out}", WRAPPER, *args]
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        self.id = int(done.stdout.strip().split(";")[0])

    def wait(self, timeout: float = 180) -> dict:
        """Until the job has ended for good (a requeued job goes back to PENDING); bounded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.slurm.job(self.id)
            if job["JobState"] in ENDED:
                return job
            time.sleep(0.1)  # scontrol answers from slurmctld's memory: cheap to ask often
        raise AssertionError(f"job {self.id} still {job['JobState']} after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def survivors(self, timeout: float = 10) -> list:
        deadline = time.monotonic() + timeout
        while processes_with_marker(self.marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        return processes_with_marker(self.marker)


def test_a_preempted_job_saves_one_step_requeues_itself_and_resumes_there(slurm, tmp_path):
    ready = tmp_path / "ready"
    job = BatchJob(
        slurm,
        tmp_path,
        "--nproc",
        "1",
        BEATER,
        "--steps",
        "250",
        "--step-time",
        "0.05",
        "--collective",  # one gloo group across the two nodes
        "--stop-aware",
        "--save-every",
        "20",
        "--crash-at",
        "30",
        "--ready-dir",
        str(ready),
    )
    # The crash on node 2 restarted both nodes: each rank has made attempt 1's first step.
    wait_for_files(ready, "rank_*.attempt_1", 2, timeout=120)
    slurm.run("scancel", "--signal=USR1", "--batch", str(job.id))  # what --signal=B:USR1@120 does

    ended = job.wait()
    text = job.output()
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", text
    assert ended["Restarts"] == "1", text
    stopped = re.findall(r"rank (\d) stopped at step (\d+) on request", text)
    assert sorted(rank for rank, _ in stopped) == ["0", "1"], text
    assert len({step for _, step in stopped}) == 1, text  # one step on every rank of every node
    step = int(stopped[0][1])
    assert "exit 143): requeueing job" in text and "restart 1," in text
    for rank in (0, 1):  # zero lost steps: the requeued job goes on from the step after the saved one
        assert f"rank {rank} attempt 2 starts at step {step + 1}" in text, text
    assert f"newest committed step {step};" in text  # what the requeued job found in storage
    run = tmp_path / "runs" / f"beater-job{job.id}"
    state = json.loads((run / "run.json").read_text())
    assert [a["outcome"] for a in state["attempts"]] == ["FAILED", "PREEMPTED", "SUCCEEDED"]
    assert state["attempts"][0]["failures"][0]["node"] == 1
    assert job.survivors() == []


def test_a_usage_error_is_not_requeued(slurm, tmp_path):
    job = BatchJob(slurm, tmp_path, "--nproc", "0", BEATER)
    ended = job.wait(60)
    text = job.output()
    assert ended["JobState"] == "FAILED" and ended["ExitCode"] == "2:0", text
    assert ended["Restarts"] == "0" and "requeueing" not in text, text
    assert "--nproc must be at least 1" in text
    assert job.survivors() == []


# Node 1 fails its health check at every start (exit 8); the standby, node 2, trains in its place.
UNHEALTHY_1 = 'test "$FTLAUNCH_NODE_RANK" != 1 || { echo "no InfiniBand link"; exit 1; }'
DRAIN_1 = (
    'scontrol update nodename=node2 state=drain reason="ftlaunch: node 1 is unhealthy: --health-check '
    "failed: exit 1; last output: no InfiniBand link"
)


def standby_job(slurm, tmp_path: Path, *args: str) -> BatchJob:
    """2 nodes train and 1 stands by: --nodes=3 and FTLAUNCH_STANDBY_NODES=1, no --nnodes."""
    check = ("--health-check", UNHEALTHY_1)
    return BatchJob(slurm, tmp_path, *check, *args, nodes=3, env={"FTLAUNCH_STANDBY_NODES": "1"})


def test_a_node_that_exits_8_is_named_for_draining_and_the_job_that_finished_succeeds(slurm, tmp_path):
    """srun returns its highest task's code, node 1's 8; the job's is node 0's (0): COMPLETED 0:0,
    and node 1 is named by its host with the scontrol line that drains it, printed, not run."""
    job = standby_job(slurm, tmp_path, "--nproc", "1", BEATER, "--steps", "20", "--collective")
    ended = job.wait()
    text = job.output()
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", text
    assert "node2: task 1: Exited with exit code 8" in text  # srun's own word: the step went on
    assert "node 1 (node2) is unhealthy or excluded (exit 8): drain it or replace it" in text, text
    assert DRAIN_1 in text, text
    state = json.loads((job.runs / f"beater-job{job.id}" / "run.json").read_text())
    (attempt,) = state["attempts"]
    assert attempt["outcome"] == "SUCCEEDED", attempt
    assert {n["node"]: n.get("position") for n in attempt["nodes"]} == {0: 0, 2: 1}, attempt  # the standby's
    assert slurm.run("sinfo", "-h", "-R").strip() == "", "the wrapper drained a node itself"
    assert job.survivors() == []


def test_a_preempted_job_with_an_unhealthy_node_is_requeued_and_resumes(slurm, tmp_path):
    """The notice stops node 0 (exit 143) while node 1 left with 8: the job requeues; the requeued
    job (node 1 unhealthy again) resumes on the standby and ends COMPLETED 0:0."""
    ready = tmp_path / "ready"
    beater = (BEATER, "--steps", "150", "--collective", "--stop-aware", "--ready-dir", str(ready))
    job = standby_job(slurm, tmp_path, "--nproc", "1", *beater)
    wait_for_files(ready, "rank_*.attempt_0", 2, timeout=120)  # both positions trained a step
    slurm.run("scancel", "--signal=USR1", "--batch", str(job.id))

    ended = job.wait()
    text = job.output()
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", text
    assert ended["Restarts"] == "1", text
    assert "exit 143): requeueing job" in text and "restart 1," in text, text
    assert text.count(DRAIN_1) == 2, text  # once in each run of the job
    state = json.loads((job.runs / f"beater-job{job.id}" / "run.json").read_text())
    assert [a["outcome"] for a in state["attempts"]] == ["PREEMPTED", "SUCCEEDED"], text
    assert job.survivors() == []
