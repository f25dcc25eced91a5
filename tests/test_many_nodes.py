"""Many nodes on one machine: each "node" is its own ftlaunch process (its own log dir), all on
loopback, meeting through torch.distributed.elastic's c10d rendezvous on node 0's store."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
from helpers import ACTOR, MARKER, ROOT, SCRIPTS, Launch, processes_with_marker, run_state, wait_for_files

from launcher.core.events import Hang, NodesMet, PeerInterrupt, Transition
from launcher.grammar.errors import UsageError

# Several launches (a fault-free run, relaunches), each with its own bounded waits: on a loaded
# machine more than the suite's 120 s. The limit is a hang guard, not a measure of speed. The
# nodes' meeting is the subject, not how the workers start (the many-node chaos tests fork them).
pytestmark = [pytest.mark.timeout(300), pytest.mark.exec_workers]

TRAIN = str(SCRIPTS / "ckpt_train.py")
BEATER = str(SCRIPTS / "beater.py")
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


class Job:
    """The same command on ``nnodes`` nodes; ``start(r)`` (re)starts node r. ``fewest``: the job is
    elastic (--nnodes FEWEST:NNODES)."""

    def __init__(
        self, launcher, tmp_path, nnodes, *args, node_timeout="3s", host="127.0.0.1", env=None, fewest=None
    ):
        self.launcher, self.tmp_path, self.nnodes = launcher, tmp_path, nnodes
        self.nnodes_flag = f"{fewest}:{nnodes}" if fewest else str(nnodes)
        self.endpoint = f"{host}:{free_port(host)}"
        self.args, self.node_timeout, self.env = args, node_timeout, {**LOOPBACK, **(env or {})}
        self.nodes = {}

    def start(self, rank: int, *extra: str, env=None) -> Launch:
        """``env``: more environment for this node alone."""
        launch = self.launcher.start(
            "--nnodes",
            self.nnodes_flag,
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            self.endpoint,
            "--node-timeout",
            self.node_timeout,
            *extra,
            *self.args,
            log_dir=self.tmp_path / f"logs_{rank}_{len(self.launcher.launches)}",
            env={**self.env, **(env or {})},
        )
        launch.log_dir = launch.log_dir / f"node{rank}"  # each node's logs under its own name
        self.nodes[rank] = launch
        return launch

    def start_all(self):
        for rank in range(self.nnodes):
            self.start(rank)
        return self

    def wait(self, timeout=120):
        codes = {rank: launch.wait(timeout) for rank, launch in self.nodes.items()}
        return codes

    def survivors(self):
        return [p for launch in self.nodes.values() for p in launch.survivors()]


def _status_table(tmp_path, name) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "status", "--run-dir", str(tmp_path / "runs"), name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _status_when(tmp_path, name, ready, timeout=30) -> dict:
    """``ftlaunch status --json`` once its live progress satisfies ``ready``; bounded."""
    from launcher.cli.status import run_status

    deadline = time.monotonic() + timeout
    while True:
        try:
            report = run_status(str(tmp_path / "runs" / name))
        except UsageError:  # no run.json yet: a fresh run writes it once its first group runs
            report = {"progress": None}
        progress = report["progress"] and report["progress"].to_json()  # as --json gives it
        if progress and ready(progress):
            return {**report, "progress": progress}
        assert time.monotonic() < deadline, progress
        time.sleep(0.2)


def test_a_crash_on_one_node_restarts_every_node_and_ends_bit_identical(launcher, tmp_path):
    """One rank per node: with two ranks a sum has one order, so DDP's gradients match bit for bit
    (with more, DDP's bucket rebuild after a restart changes gloo's summation order)."""
    clean_out, out = tmp_path / "clean.pt", tmp_path / "crashed.pt"
    clean = Job(launcher, tmp_path, 2, "--nproc", "1", "--run-name", "clean", TRAIN, "--out", str(clean_out))
    assert clean.start_all().wait(180) == {0: 0, 1: 0}, clean.nodes[0].stderr
    job = Job(
        launcher,
        tmp_path,
        2,
        "--nproc",
        "1",
        "--run-name",
        "two",
        TRAIN,
        "--out",
        str(out),
        "--crash",
        "7:0",
        "--crash-rank",
        "1",
    ).start_all()
    codes = job.wait(180)
    assert codes == {0: 0, 1: 0}, (job.nodes[0].stderr, job.nodes[1].stderr)
    # One job: node 1's crash stopped node 0's rank too, and both ran attempt 1 from one checkpoint
    # (saves are asynchronous: step 5 may or may not have been committed before the crash at 7).
    starts = {re.search(r"attempt 1 starts at step (\d+)", job.nodes[r].stdout).group(1) for r in range(2)}
    assert starts in ({"0"}, {"5"}), starts
    interrupts = job.nodes[0].events(PeerInterrupt)
    assert [(e.node, e.kind) for e in interrupts] == [(1, "failure")]
    # The same nodes restarting at once keep torch's rendezvous round (it costs about a second).
    for r in range(2):
        assert [e.new_round for e in job.nodes[r].events(NodesMet)] == [True, False]
    state = run_state(tmp_path / "runs" / "two")
    assert [a.outcome for a in state.attempts] == ["FAILED", "SUCCEEDED"]  # counted once, globally
    assert state.attempts[0].failures[0].node == 1
    assert "rank 1 (node 1" in state.attempts[0].failures[0].detail
    a, b = torch.load(clean_out), torch.load(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert job.survivors() == [] and clean.survivors() == []


def test_workers_see_torchruns_multi_node_environment(launcher, tmp_path):
    marker = uuid.uuid4().hex
    port = free_port()
    env = {**os.environ, **LOOPBACK, MARKER: marker, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    theirs_dir, ours_dir = tmp_path / "torchrun", tmp_path / "ftlaunch"
    torchruns = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "envtest",
                "--max-restarts",
                "0",
                "--local-addr",
                "127.0.0.1",
                str(ACTOR),
                "--env-dir",
                str(theirs_dir),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in torchruns:
        assert proc.wait(120) == 0, proc.stderr.read()
    assert processes_with_marker(marker) == []
    job = Job(
        launcher,
        tmp_path,
        2,
        "--nproc",
        "2",
        "--max-failures",
        "0",
        str(ACTOR),
        "--env-dir",
        str(ours_dir),
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    ).start_all()
    assert job.wait() == {0: 0, 1: 0}, job.nodes[1].stderr

    base = dict(os.environ, **LOOPBACK, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    run_specific = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", MARKER}
    # torchrun's workers host their own store when its sharing is off; ftlaunch's supervisor on
    # node 0 hosts it (a fresh one per attempt), so ours connect as clients.
    run_specific.add("TORCHELASTIC_USE_AGENT_STORE")
    agent_only = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
    ours_only = {
        "GRPC_VERBOSITY",  # ERROR unless set: grpc's INFO lines off the console (environment.md)
        "FTLAUNCH_ATTEMPT",
        "FTLAUNCH_BACKEND",
        "FTLAUNCH_HEARTBEAT_FILE",
        "FTLAUNCH_CHECKPOINT_URL",
        "FTLAUNCH_MEMORY_DIR",
        "TORCH_FR_BUFFER_SIZE",  # 512 unless set: torch's flight recorder, for the stragglers
    }
    for rank in range(4):
        theirs = {k: v for k, v in _env(theirs_dir, rank).items() if base.get(k) != v}
        ours = {k: v for k, v in _env(ours_dir, rank).items() if base.get(k) != v}
        assert set(theirs) - agent_only - {MARKER} == set(ours) - ours_only - {MARKER}
        for name in set(theirs) - run_specific - agent_only:
            assert ours[name] == theirs[name], (rank, name, ours[name], theirs[name])
        assert ours["GROUP_RANK"] == str(rank // 2) and ours["WORLD_SIZE"] == "4"
    assert job.survivors() == []


def _env(folder, rank):
    return json.loads((folder / f"rank_{rank}.attempt_0.json").read_text())


def test_a_hang_on_the_third_node_restarts_all_three(launcher, tmp_path):
    """Node 0 on 127.0.0.2: the job's store is bound to exactly the endpoint's address."""
    job = Job(
        launcher,
        tmp_path,
        3,
        "--nproc",
        "1",
        "--heartbeat-timeout",
        "2s",
        "--run-name",
        "hang",
        BEATER,
        "--steps",
        "40",
        "--hang",
        "sleep",
        "--hang-rank",
        "2",
        "--hang-at",
        "5",
        host="127.0.0.2",
    ).start_all()
    assert job.wait(180) == {0: 0, 1: 0, 2: 0}, job.nodes[2].stderr
    hangs = job.nodes[2].events(Hang)
    assert [h.rank for h in hangs] == [2]
    for rank in (0, 1):
        assert [(e.node, e.kind) for e in job.nodes[rank].events(PeerInterrupt)] == [(2, "failure")]
    state = run_state(tmp_path / "runs" / "hang")
    assert [a.outcome for a in state.attempts] == ["FAILED", "SUCCEEDED"]
    assert state.attempts[0].failures[0].cause == "hang"
    assert job.survivors() == []


def test_the_failure_budget_is_counted_once_per_job(launcher, tmp_path):
    job = Job(
        launcher,
        tmp_path,
        2,
        "--nproc",
        "1",
        "--max-failures",
        "3",
        "--crash-loop",
        "0",
        "--backoff",
        "0.2s",
        "--run-name",
        "budget",
        str(ACTOR),
        "--fail",
        "exit",
        "--fail-rank",
        "1",
        "--fail-attempts",
        "all",
        "--others",
        "wait",
        "--beat",  # every attempt beats step 0: the 1st made progress, the others are known not to
    ).start_all()
    assert job.wait() == {0: 1, 1: 1}
    state = run_state(tmp_path / "runs" / "budget")
    assert [a.outcome for a in state.attempts] == ["FAILED"] * 4  # not nnodes x budget
    assert "FAILED after 4 attempt(s)" in job.nodes[1].stderr  # node 1 says what node 0 decided
    # Two restarts at once keep the round; the 2nd failure in a row without progress waits out a
    # backoff, and the nodes meet anew.
    for r in range(2):
        assert [e.new_round for e in job.nodes[r].events(NodesMet)] == [True, False, False, True]
    assert job.survivors() == []


def _stepping_job(launcher, tmp_path, nnodes, name):
    """One rank per node, stepping for 3 s an attempt (attempt 0 until the test stops it);
    returned once every rank has stepped."""
    ready = tmp_path / "ready"
    job = Job(
        launcher,
        tmp_path,
        nnodes,
        "--nproc",
        "1",
        "--run-name",
        name,
        BEATER,
        "--steps",
        "60",
        "--step-time",
        "0.05",
        "--ready-dir",
        str(ready),
        "--until-attempt",
        "1",
    ).start_all()
    # A hang guard: 3 nodes importing torch on a loaded machine took more than 60 s.
    wait_for_files(ready, "rank_*.attempt_0", nnodes, timeout=180)
    return job


def test_a_dead_node_supervisor_stops_the_others_and_its_relaunch_resumes_the_job(launcher, tmp_path):
    job = _stepping_job(launcher, tmp_path, 3, "lost")
    os.kill(job.nodes[1].proc.pid, signal.SIGKILL)
    job.nodes[1].wait(10)
    # Node 0 declares node 1 lost (--node-timeout 3 s) and every node stops its workers.
    lost = job.nodes[0].wait_for_event(Transition, lambda e: e.new == "STOPPED", 60)
    assert lost.attempt == 0
    job.nodes[2].wait_for_event(PeerInterrupt, lambda e: e.kind == "lost", 30)
    first = job.nodes[1]
    assert first.survivors_after(10) == []
    job.start(1)  # the same command, relaunched on node 1
    codes = job.wait(120)
    assert codes == {0: 0, 1: 0, 2: 0}, job.nodes[0].stderr
    state = run_state(tmp_path / "runs" / "lost")
    assert [a.outcome for a in state.attempts] == ["NODE_LOST", "SUCCEEDED"]  # not a worker failure
    assert state.attempts[0].failures[0].cause == "node_lost"
    assert "node 1" in state.attempts[0].failures[0].detail
    assert [e.new_round for e in job.nodes[0].events(NodesMet)] == [True, True]  # a lost node: anew
    assert job.survivors() == []


def test_a_dead_node_0_is_waited_for_and_its_relaunch_resumes_the_job(launcher, tmp_path):
    job = _stepping_job(launcher, tmp_path, 2, "leader")
    os.kill(job.nodes[0].proc.pid, signal.SIGKILL)
    job.nodes[0].wait(10)
    job.nodes[1].wait_for_event(Transition, lambda e: e.new == "STOPPED", 30)
    assert job.nodes[0].survivors_after(10) == []
    job.start(0)
    assert job.wait(120) == {0: 0, 1: 0}, (job.nodes[0].stderr, job.nodes[1].stderr)
    state = run_state(tmp_path / "runs" / "leader")
    assert [a.outcome for a in state.attempts] == ["SUPERVISOR_LOST", "SUCCEEDED"]
    assert "lost node 0" in job.nodes[1].stderr
    assert job.survivors() == []


def test_a_preemption_stops_every_node_at_one_step_and_the_relaunch_resumes_there(launcher, tmp_path):
    ready = tmp_path / "ready"

    def args(steps):
        return (
            "--nproc",
            "2",
            "--run-name",
            "preempt",
            "--grace-period",
            "20",
            BEATER,
            "--steps",
            str(steps),
            "--step-time",
            "0.02",
            "--stop-aware",
            "--save-every",
            "1000000",
        )

    job = Job(launcher, tmp_path, 2, *args(100000), "--ready-dir", str(ready)).start_all()
    wait_for_files(ready, "rank_*.attempt_0", 4, timeout=60)
    live = _status_when(
        tmp_path, "preempt", lambda p: len([r for r in p["ranks"] if r["step"] is not None]) == 4
    )
    assert [(n["node"], n["pid"], n["lost"]) for n in live["progress"]["nodes"]] == [
        (rank, job.nodes[rank].proc.pid, False) for rank in (0, 1)
    ]
    assert sorted((r["node"], r["rank"]) for r in live["progress"]["ranks"]) == [
        (0, 0),
        (0, 1),
        (1, 2),
        (1, 3),
    ]
    table = _status_table(tmp_path, "preempt")
    assert "nodes of attempt 0" in table and f"{job.nodes[1].proc.pid}" in table
    # One node gets SLURM's preemption notice: every node stops, and calls it by its name (node 0
    # said "interrupted by SIGTERM", a signal nobody sent).
    os.kill(job.nodes[1].proc.pid, signal.SIGUSR1)
    assert job.wait(60) == {0: 143, 1: 143}, (job.nodes[0].stderr, job.nodes[1].stderr)
    for node in (0, 1):
        assert "interrupted by SIGUSR1 (the preemption notice)" in job.nodes[node].stderr, job.nodes[
            node
        ].stderr
    stopped = [
        int(line.split("at step ")[1].split()[0])
        for launch in job.nodes.values()
        for line in launch.stdout.splitlines()
        if "stopped at step" in line
    ]
    assert len(stopped) == 4 and len(set(stopped)) == 1, (stopped, job.nodes[0].stderr, job.nodes[1].stderr)
    step = stopped[0]
    assert (tmp_path / "runs" / "preempt" / "checkpoints" / f"step_{step}" / "COMMITTED").exists()
    state = run_state(tmp_path / "runs" / "preempt")
    assert state.status == "PREEMPTED" and state.reason == "interrupted by SIGUSR1 (the preemption notice)"
    nodes = state.attempts[0].nodes
    assert [(n["node"], n["pid"]) for n in nodes] == [(r, job.nodes[r].proc.pid) for r in (0, 1)]
    assert job.survivors() == []
    # The same command on both nodes resumes from that step: nothing lost.
    job2 = Job(launcher, tmp_path, 2, *args(step + 20)).start_all()
    assert job2.wait(120) == {0: 0, 1: 0}, job2.nodes[0].stderr
    for rank in range(4):
        assert f"rank {rank} attempt 1 starts at step {step + 1}" in job2.nodes[rank // 2].stdout
    assert job2.survivors() == []


def test_a_node_that_never_arrives_ends_at_the_join_timeout(launcher, tmp_path):
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--join-timeout", "3s", str(ACTOR))
    job.start(0)
    assert job.wait(60) == {0: 5}
    assert "not every one of the 2 nodes joined within --join-timeout (3 s)" in job.nodes[0].stderr
    follower = Job(launcher, tmp_path, 2, "--nproc", "1", "--join-timeout", "2s", str(ACTOR))
    follower.start(1)
    assert follower.wait(60) == {1: 5}
    assert "node 0 did not answer" in follower.nodes[1].stderr
    # Waiting is said in one line (every 30 s), without torch's C++ traces of each refused try.
    assert follower.nodes[1].stderr.count("waiting for node 0 at") == 1, follower.nodes[1].stderr
    assert "socket.cpp" not in follower.nodes[1].stderr and "frame #" not in follower.nodes[1].stderr
    assert job.survivors() == [] and follower.survivors() == []


def test_nodes_that_disagree_are_refused_before_any_worker_starts(launcher, tmp_path):
    job = Job(launcher, tmp_path, 2, "--join-timeout", "30s", str(ACTOR))
    job.start(0, "--nproc", "1")
    job.start(1, "--nproc", "2")
    assert job.wait(60) == {0: 2, 1: 2}
    for launch in job.nodes.values():
        assert "node 1 (" in launch.stderr and "runs --nproc 2, node 0 runs --nproc 1" in launch.stderr
        assert not (launch.log_dir / "attempt_0").exists()
    assert job.survivors() == []


def test_nodes_started_with_other_script_arguments_are_refused_at_once(launcher, tmp_path):
    """No --run-name: the arguments make the run's name, and so the rendezvous id, differ; the
    nodes would never meet. Both are told so (exit 2) instead of waiting out --join-timeout."""
    job = Job(launcher, tmp_path, 2, "--nproc", "1", "--join-timeout", "10m")
    job.start(0, str(ACTOR), "--run-for", "1")
    job.start(1, str(ACTOR), "--run-for", "2")
    assert job.wait(60) == {0: 2, 1: 2}, (job.nodes[0].stderr, job.nodes[1].stderr)
    for launch in job.nodes.values():
        assert "node 1 (" in launch.stderr and "runs another command than node 0" in launch.stderr
        assert "--run-for 2" in launch.stderr
    assert job.survivors() == []


def test_a_second_node_with_a_taken_node_rank_is_refused_and_the_job_goes_on(launcher, tmp_path):
    go = tmp_path / "go"  # the ranks wait for it: the job runs until the duplicate was refused
    command = ["--nproc", "1", "--run-name", "twice", str(ACTOR), "--go-file", str(go), "--run-for", "0"]
    job = Job(launcher, tmp_path, 2, *command).start_all()
    for rank in range(2):  # both nodes claimed their ranks and met
        job.nodes[rank].wait_for_event(NodesMet, timeout=90)
    duplicate = job.launcher.start(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", job.endpoint, "--node-timeout", "3s",
        *command, log_dir=tmp_path / "dup", env=job.env,
    )  # fmt: skip
    assert duplicate.wait(60) == 2, duplicate.stderr
    assert "node rank 1 is already held by the supervisor on" in duplicate.stderr
    assert "which is alive" in duplicate.stderr
    go.touch()
    assert job.wait(120) == {0: 0, 1: 0}, (job.nodes[0].stderr, job.nodes[1].stderr)
    state = run_state(tmp_path / "runs" / "twice")
    assert [a.outcome for a in state.attempts] == ["SUCCEEDED"]  # the job never noticed
    assert job.survivors() == [] and duplicate.survivors() == []


def test_a_node_that_comes_after_the_job_succeeded_ends_at_once(launcher, tmp_path):
    """Node 0 has finished and its store is gone; the run dir (shared, as under SLURM) says the
    run succeeded: a node started now exits 6 at once, not at --join-timeout."""
    job = Job(
        launcher, tmp_path, 2, "--nproc", "1", "--run-name", "over", "--join-timeout", "10m", str(ACTOR)
    )
    assert job.start_all().wait(120) == {0: 0, 1: 0}, job.nodes[0].stderr
    late = job.start(1)
    assert late.wait(60) == 6, late.stderr
    assert "the job has ended: run" in late.stderr and "succeeded at" in late.stderr
    assert job.survivors() == []


def test_a_node_that_joins_a_closed_rendezvous_ends_at_once(launcher, tmp_path, monkeypatch):
    """Node 0 (here: this test, through ftlaunch's own rendezvous code) has closed the job's
    rendezvous, as it does when the job ends; a node started now is told so and exits 6 at once,
    not after its --join-timeout."""
    from launcher.cluster.rendezvous import Rendezvous, host_job_store
    from launcher.core.config import LaunchConfig

    job = Job(
        launcher, tmp_path, 2, "--nproc", "1", "--rdzv-id", "closed", "--join-timeout", "10m", str(ACTOR)
    )
    leader = LaunchConfig.of(
        entrypoint=str(ACTOR), nnodes=2, node_rank=0, rdzv_endpoint=job.endpoint, rdzv_id="closed"
    )
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # Rendezvous sets it: undone after
    store = host_job_store(leader.cluster)
    Rendezvous(leader.cluster, leader.run.run_id, store).close()
    job.start(1)
    assert job.wait(60) == {1: 6}, job.nodes[1].stderr
    assert "the job has ended: its rendezvous is closed" in job.nodes[1].stderr
    assert job.survivors() == []
