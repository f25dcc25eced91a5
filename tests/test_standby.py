"""Standby nodes (--standby-nodes, issue 50): N + K ftlaunch processes on loopback meet, N train
and K stand by; a training node's whole tree killed is replaced by a standby at its position, with
its GROUP_RANK and RANKs, not counted as a failure (--max-failures 0 holds throughout)."""

import re
import shutil
import signal
import socket

import psutil
import pytest
from helpers import SCRIPTS, memory_folders, run_state, until, wait_for_files
from test_many_nodes import Job, _status_table

from launcher.core.events import Decision, NodeReplaced, NodesMet, StandbyLost
from launcher.core.outcomes import AttemptOutcome
from launcher.observe.plot import draw_run, node_events
from launcher.runs.directory import RunDir

# Four supervisors and their workers on two cores; the limit is a hang guard, not a measure of speed.
pytestmark = pytest.mark.timeout(300)

TRAIN = str(SCRIPTS / "ckpt_train.py")


def _standby_job(launcher, tmp_path, name: str, *script_args: str, options=(), fewest=None) -> Job:
    """3 training nodes of one rank each and 1 standby, failing at the first failure (so that a
    replacement counted as one would show)."""
    ours = ["--standby-nodes", "1", "--nproc", "1", "--max-failures", "0", "--run-name", name, *options]
    return Job(launcher, tmp_path, 3, *ours, TRAIN, *script_args, node_timeout="3s", fewest=fewest)


def _start(job: Job, members: int = 4, node0: tuple = ()) -> Job:
    """The followers first, each until it polls for node 0, then node 0 (with ``node0``'s own
    options): they join its first round together (the lowest node ranks train)."""
    for rank in range(1, members):
        job.start(rank)
    for rank in range(1, members):
        job.nodes[rank].read_console_until(lambda line: "waiting for node 0 at" in line, 120, stream="stderr")
    job.start(0, *node0)
    return job


def _kill_tree(*launches) -> None:
    """Nodes lost for good, at once: each supervisor and every process it started, and its memory
    in /dev/shm with it (its orphan guard, killed too, would have removed it)."""
    procs = [p for launch in launches for p in (psutil.Process(launch.proc.pid), *launch.survivors())]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for launch in launches:
        launch.wait(30)
        for folder in memory_folders(launch.proc.pid):
            shutil.rmtree(folder, ignore_errors=True)


def _lines(stdout: str, pattern: str) -> dict:
    return {tuple(map(int, m[:-1])): int(m[-1]) for m in re.findall(pattern, stdout)}


def test_a_standby_takes_a_lost_nodes_place_with_its_ranks_and_the_node_back_stands_by(launcher, tmp_path):
    out = tmp_path / "out.pt"
    args = ["--steps", "120", "--step-time", "0.05", "--save-every", "10", "--out", str(out)]
    job = _standby_job(launcher, tmp_path, "standby", *args, "--until-attempt", "1")
    metrics = tmp_path / "node0.prom"
    node0 = _start(job, node0=("--metrics-file", str(metrics))).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    assert first.nodes[0] == 0 and len(first.nodes) == 3 and len(first.standby) == 1, first
    (standby,) = first.standby
    lost = first.nodes[2]  # the node at position 2 (GROUP_RANK 2, RANK 2)
    job.nodes[standby].read_console_until(lambda line: "stands by" in line, 60, stream="stderr")
    wait_for_files(tmp_path / "runs" / "standby" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)

    _kill_tree(job.nodes[lost])
    replaced = node0.wait_for_event(NodesMet, lambda e: e.attempt == 1, timeout=120)
    assert replaced.nodes == [first.nodes[0], first.nodes[1], standby], replaced
    assert replaced.standby == [] and not replaced.new_round, replaced  # the round's standby, at once

    # The lost node relaunched while the job trains: it waits outside the round, disturbing nothing.
    back = job.start(lost)
    back.read_console_until(lambda line: "came while the job trains without it" in line, 120, stream="stderr")
    codes = {rank: job.nodes[rank].wait(180) for rank in (0, first.nodes[1], standby, lost)}
    assert codes == {0: 0, first.nodes[1]: 0, standby: 0, lost: 0}, (node0.stderr, back.stderr)
    assert [e.attempt for e in node0.events(NodesMet)] == [0, 1]  # the node back started no attempt

    # The standby ran rank 2 (GROUP_RANK 2) at WORLD_SIZE 3, from the per-rank checkpoint of rank 2.
    standby_out = job.nodes[standby].stdout
    assert "rank 2 attempt 1 has WORLD_SIZE 3" in standby_out, standby_out
    starts = _lines(standby_out, r"rank (\d+) attempt (\d+) starts at step (\d+)")
    assert starts[(2, 1)] >= 10, starts

    # Not a failure (--max-failures 0 held), and every record says who took whose place and why.
    assert [d.verdict for d in node0.events(Decision)] == ["replace"]
    (event,) = node0.events(NodeReplaced)
    assert (event.attempt, event.position, event.node, event.replaced) == (1, 2, standby, lost), event
    state = run_state(tmp_path / "runs" / "standby")
    assert [a.outcome for a in state.attempts] == [AttemptOutcome.NODE_LOST, AttemptOutcome.SUCCEEDED]
    took = f"node {standby} took node {lost}'s place (GROUP_RANK 2, RANK 2): node {lost} ("
    assert "lost: its supervisor is gone (its connection to node 0 closed" in event.why, event.why
    assert state.attempts[1].replaced.startswith(took), state.attempts[1].replaced
    positions = {n["node"]: n.get("position") for n in state.attempts[1].nodes}
    assert positions == {0: 0, first.nodes[1]: 1, standby: 2}, state.attempts[1].nodes
    assert {n["node"]: n.get("standby") for n in state.attempts[0].nodes}[standby] is True
    assert took in node0.stderr and "a standby node takes its place" in node0.stderr
    assert f"attempt 1: {took}" in _status_table(tmp_path, "standby")
    events = RunDir(str(tmp_path / "runs" / "standby")).read_events()
    axes = draw_run("standby", node_events(events, None)).axes[0]
    assert [line.get_gid() for line in axes.get_lines() if line.get_gid() == "replaced/attempt1"]
    final = metrics.read_text()
    assert re.search(r"^ftlaunch_replacements_total\{[^}]*\} 1\.0$", final, re.M), final
    assert re.search(r"^ftlaunch_standby_nodes\{[^}]*\} 0\.0$", final, re.M), final
    assert job.survivors() == []


def test_a_training_node_and_the_standby_lost_at_once_wait_for_a_node_to_come(launcher, tmp_path):
    """No standby left to take the place: the fixed job waits, as without standby nodes, and the
    node relaunched in the lost standby's stead takes the free position."""
    out = tmp_path / "out.pt"
    args = ["--steps", "80", "--step-time", "0.05", "--save-every", "10", "--out", str(out)]
    wait = ["--join-timeout", "120s"]
    job = _standby_job(launcher, tmp_path, "both", *args, "--until-attempt", "1", options=wait)
    node0 = _start(job).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    lost = first.nodes[2]
    wait_for_files(tmp_path / "runs" / "both" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)
    _kill_tree(job.nodes[lost], job.nodes[standby])
    # Node 0 waits in a new round (at once, or after the round it called the standby to fails).
    node0.read_console_until(lambda line: "waiting for at least 3 of the 4 nodes" in line, 90, "stderr")
    job.start(standby)  # a node in the standby's stead: the only one to fill position 2
    again = node0.wait_for_event(NodesMet, lambda e: e.attempt == 1, timeout=120)
    assert again.nodes == [0, first.nodes[1], standby] and again.standby == [], again
    codes = {rank: job.nodes[rank].wait(180) for rank in (0, first.nodes[1], standby)}
    assert codes == {0: 0, first.nodes[1]: 0, standby: 0}, node0.stderr
    assert {d.verdict for d in node0.events(Decision)} <= {"node_lost", "replace"}  # not a failure
    assert "no standby node is left (--standby-nodes 1)" in node0.stderr
    assert "rank 2 attempt 1 has WORLD_SIZE 3" in job.nodes[standby].stdout
    assert job.survivors() == []


def test_two_lost_with_one_standby_an_elastic_job_takes_the_standby_and_shrinks(launcher, tmp_path):
    out = tmp_path / "out.pt"
    args = ["--steps", "80", "--step-time", "0.05", "--save-every", "10", "--replicated", "--out", str(out)]
    job = _standby_job(launcher, tmp_path, "shrink", *args, "--until-attempt", "1", fewest=2)
    node0 = _start(job).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    wait_for_files(tmp_path / "runs" / "shrink" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)
    _kill_tree(job.nodes[first.nodes[1]], job.nodes[first.nodes[2]])
    shrunk = node0.wait_for_event(NodesMet, lambda e: e.attempt == 1, timeout=120)
    assert shrunk.nodes == [0, standby] and shrunk.standby == [], shrunk  # position 1: the standby's
    codes = {rank: job.nodes[rank].wait(180) for rank in (0, standby)}
    assert codes == {0: 0, standby: 0}, node0.stderr
    assert "rank 1 attempt 1 has WORLD_SIZE 2" in job.nodes[standby].stdout
    assert [d.verdict for d in node0.events(Decision)] == ["resize"]
    assert job.survivors() == []


def test_a_standby_that_comes_late_stands_by_and_takes_the_next_lost_place(launcher, tmp_path):
    out = tmp_path / "out.pt"
    args = ["--steps", "100", "--step-time", "0.05", "--save-every", "10", "--out", str(out)]
    job = _standby_job(launcher, tmp_path, "late", *args, "--until-attempt", "1")
    node0 = _start(job, members=3).nodes[0]  # nodes 0-2: the job starts without its standby
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    assert first.nodes == [0, 1, 2] and first.standby == [], first
    late = job.start(3)
    late.read_console_until(lambda line: "came while the job trains without it" in line, 120, "stderr")
    wait_for_files(tmp_path / "runs" / "late" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)
    _kill_tree(job.nodes[1])
    again = node0.wait_for_event(NodesMet, lambda e: e.attempt == 1, timeout=120)
    assert again.nodes == [0, 3, 2] and again.new_round, again  # torch's next round, with the late node
    codes = {rank: job.nodes[rank].wait(180) for rank in (0, 2, 3)}
    assert codes == {0: 0, 2: 0, 3: 0}, (node0.stderr, late.stderr)
    assert "rank 1 attempt 1 has WORLD_SIZE 3" in late.stdout
    assert [d.verdict for d in node0.events(Decision)] == ["replace"]  # by the node outside the round
    assert "a node waiting outside the round takes its place in a new round" in node0.stderr
    assert job.survivors() == []


def test_a_standby_frozen_when_it_is_called_is_waited_for_and_takes_the_place_when_it_wakes(
    launcher, tmp_path
):
    out = tmp_path / "out.pt"
    args = ["--steps", "80", "--step-time", "0.05", "--save-every", "10", "--out", str(out)]
    wait = ["--join-timeout", "120s"]
    job = _standby_job(launcher, tmp_path, "frozen", *args, "--until-attempt", "1", options=wait)
    node0 = _start(job).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    lost = first.nodes[2]
    wait_for_files(tmp_path / "runs" / "frozen" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)
    job.nodes[standby].proc.send_signal(signal.SIGSTOP)
    try:
        _kill_tree(job.nodes[lost])
        # Called while frozen: the round it was to take the place in fails, and node 0 meets anew.
        node0.read_console_until(lambda line: "the nodes meet again in a new round" in line, 90, "stderr")
    finally:
        job.nodes[standby].proc.send_signal(signal.SIGCONT)
    again = node0.wait_for_event(NodesMet, lambda e: e.attempt == 1, timeout=120)
    assert again.nodes == [0, first.nodes[1], standby], again
    codes = {rank: job.nodes[rank].wait(180) for rank in (0, first.nodes[1], standby)}
    assert codes == {0: 0, first.nodes[1]: 0, standby: 0}, (node0.stderr, job.nodes[standby].stderr)
    assert "rank 2 attempt 1 has WORLD_SIZE 3" in job.nodes[standby].stdout
    assert "failed" not in {d.verdict for d in node0.events(Decision)}
    assert job.survivors() == []


@pytest.mark.parametrize(
    "signalled, signum",
    [("standby", signal.SIGTERM), ("node 0", signal.SIGTERM), ("standby", signal.SIGUSR1)],
)
def test_a_preemption_on_any_node_while_a_standby_waits_stops_every_node_at_one_step(
    launcher, tmp_path, signalled, signum
):
    out = tmp_path / "out.pt"
    args = ["--steps", "400", "--step-time", "0.05", "--save-every", "10", "--stop-aware", "--out", str(out)]
    job = _standby_job(launcher, tmp_path, "term", *args)
    node0 = _start(job).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    wait_for_files(tmp_path / "runs" / "term" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)
    job.nodes[standby].read_console_until(lambda line: "stands by" in line, 60, stream="stderr")
    target = job.nodes[standby] if signalled == "standby" else node0
    target.proc.send_signal(signum)  # SIGUSR1: the preemption notice (--preempt-signal)
    codes = job.wait(120)
    assert codes == {rank: 143 for rank in range(4)}, (node0.stderr, job.nodes[standby].stderr)
    stops = set(re.findall(r"stops at step (\d+)", "".join(job.nodes[r].stdout for r in first.nodes)))
    assert len(stops) == 1, (stops, node0.stdout, node0.stderr)  # every rank saved one agreed step
    assert run_state(tmp_path / "runs" / "term").attempts[-1].outcome is AttemptOutcome.PREEMPTED
    assert job.survivors() == []


def test_a_bad_node_is_excluded_after_two_failures_and_a_standby_takes_its_place(launcher, tmp_path):
    """Node 2's ranks die in every attempt (a failing GPU): surely blamed twice, it exits 8 and the
    standby trains in its place; the failures count (--max-failures 2 is just enough)."""
    out = tmp_path / "out.pt"
    args = [
        "--steps",
        "40",
        "--step-time",
        "0.05",
        "--save-every",
        "10",
        "--bad-node-step",
        "3",
        "--out",
        str(out),
    ]
    job = _standby_job(launcher, tmp_path, "bad", *args, options=["--max-failures", "2"])
    for rank in (1, 3, 2):
        job.start(rank, env={"BAD_NODE": "1"} if rank == 2 else None)
        job.nodes[rank].read_console_until(lambda line: "waiting for node 0 at" in line, 120, stream="stderr")
    node0 = job.start(0)
    codes = job.wait(240)
    assert codes == {0: 0, 1: 0, 2: 8, 3: 0}, (node0.stderr, job.nodes[2].stderr)
    state = run_state(tmp_path / "runs" / "bad")
    outcomes = [(a.outcome, a.blamed_node) for a in state.attempts]
    assert outcomes == [
        (AttemptOutcome.FAILED, 2),
        (AttemptOutcome.FAILED, 2),
        (AttemptOutcome.SUCCEEDED, None),
    ], outcomes
    assert "was the root cause of 2 failures (--exclude-after 2): excluded" in node0.stderr
    assert state.attempts[2].replaced.startswith(
        "node 3 took node 2's place (GROUP_RANK 2, RANK 2): excluded"
    )
    assert "this node is excluded: node 2 (" in job.nodes[2].stderr
    assert "rank 2 attempt 2 has WORLD_SIZE 3" in job.nodes[3].stdout
    assert job.survivors() == []


def test_a_lost_standby_disturbs_nothing_and_the_last_one_gone_is_said_and_shown(launcher, tmp_path):
    out, metrics = tmp_path / "out.pt", tmp_path / "node0.prom"
    args = ["--steps", "80", "--step-time", "0.05", "--save-every", "10", "--out", str(out)]
    job = _standby_job(launcher, tmp_path, "spare", *args)
    node0 = _start(job, node0=("--metrics-file", str(metrics))).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    wait_for_files(tmp_path / "runs" / "spare" / "checkpoints", "step_*/COMMITTED", 1, timeout=90)
    _kill_tree(job.nodes[standby])
    lost = node0.wait_for_event(StandbyLost, timeout=60)
    assert (lost.attempt, lost.node, lost.left) == (0, standby, 0), lost
    codes = {rank: job.nodes[rank].wait(180) for rank in first.nodes}
    assert codes == {rank: 0 for rank in first.nodes}, node0.stderr
    assert [e.attempt for e in node0.events(NodesMet)] == [0]  # the attempt went on, alone
    assert f"standby node {standby} gone (its connection to node 0 closed): lost; the attempt goes on" in (
        node0.stderr
    )
    assert "0 standby node(s) left" in node0.stderr
    final = metrics.read_text()
    assert re.search(r"^ftlaunch_standby_nodes\{[^}]*\} 0\.0$", final, re.M), final
    assert re.search(r"^ftlaunch_replacements_total\{[^}]*\} 0\.0$", final, re.M), final
    assert job.survivors() == []


def test_a_node_that_cannot_join_the_running_job_leaves_alone_and_the_job_goes_on(launcher, tmp_path):
    """Another --nproc on a standby that comes late: once in a round it would stop the job (every
    node refuses a plan with it); it checks itself against node 0 on arrival and leaves, exit 2.
    The job trains until the test preempts it, so the misfit always finds it running (with a
    fixed number of steps, a slow start let the job end first: exit 6, "the job has ended")."""
    out = tmp_path / "out.pt"
    args = [
        "--steps",
        "100000",
        "--step-time",
        "0.05",
        "--save-every",
        "10",
        "--stop-aware",
        "--out",
        str(out),
    ]
    job = _standby_job(launcher, tmp_path, "misfit", *args)
    node0 = _start(job, members=3).nodes[0]
    node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    other = _standby_job(launcher, tmp_path, "misfit", *args, options=["--nproc", "2"])
    other.endpoint = job.endpoint
    misfit = other.start(3)
    assert misfit.wait(120) == 2, misfit.stderr
    assert "runs --nproc 1, node 3 runs --nproc 2: this node cannot join the running job" in misfit.stderr
    # The job goes on: a step committed after the misfit left, in the same attempt.
    checkpoints = tmp_path / "runs" / "misfit" / "checkpoints"

    def newest() -> int:
        steps = (int(c.parent.name.split("_")[1]) for c in checkpoints.glob("step_*/COMMITTED"))
        return max(steps, default=-1)

    left_at = newest()
    until(lambda: newest() > left_at, timeout=90)
    assert [node.proc.poll() for node in job.nodes.values()] == [None, None, None]
    node0.proc.send_signal(signal.SIGUSR1)
    codes = job.wait(120)
    assert codes == {0: 143, 1: 143, 2: 143}, node0.stderr
    assert len(run_state(tmp_path / "runs" / "misfit").attempts) == 1
    assert job.survivors() == [] and other.survivors() == []


def test_a_preemption_ends_a_node_that_waits_outside_the_round_too(launcher, tmp_path):
    """A node relaunched (or a standby late) waits outside the running attempt's round: when the job
    is preempted it ends with the others, 143, instead of waiting for node 0 to come back (it did,
    up to --join-timeout, and then took its node rank from the requeued job's own node)."""
    out = tmp_path / "out.pt"
    args = ["--steps", "400", "--step-time", "0.05", "--save-every", "10", "--stop-aware", "--out", str(out)]
    job = _standby_job(launcher, tmp_path, "outside", *args)
    node0 = _start(job, members=3).nodes[0]
    node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    late = job.start(3)
    late.read_console_until(lambda line: "came while the job trains without it" in line, 120, "stderr")
    node0.proc.send_signal(signal.SIGUSR1)
    codes = job.wait(120)
    assert codes == {0: 143, 1: 143, 2: 143, 3: 143}, (node0.stderr, late.stderr)
    assert "the job ended while node 3 stood by outside its round (node 0: " in late.stderr
    assert "waiting for node 0 to come back" not in late.stderr
    assert job.survivors() == []


def test_a_job_that_never_gets_its_nodes_ends_at_the_join_timeout_on_every_node(launcher, tmp_path):
    """Two of the 3 training nodes: nothing trains. Node 1's --join-timeout ends first, while node 0
    still waits: it ends there (exit 5) instead of taking itself for a standby outside a running
    round (which would have waited for node 0, then ended with exit 0)."""
    out = ["--out", str(tmp_path / "o")]
    follower = _standby_job(launcher, tmp_path, "short", *out, options=["--join-timeout", "8s"])
    leader = _standby_job(launcher, tmp_path, "short", *out, options=["--join-timeout", "60s"])
    leader.endpoint = follower.endpoint
    node0 = leader.start(0)
    host, port = follower.endpoint.rsplit(":", 1)
    until(lambda: _listening(host, int(port)), timeout=120, look=0.1)  # node 0 hosts the job's store
    node1 = follower.start(1)
    assert node1.wait(120) == 5, node1.stderr
    assert "did not answer" not in node1.stderr  # it met node 0: its round timed out, not its wait
    assert node0.proc.poll() is None  # node 0 still waits: the follower did not wait for it
    assert "came while the job trains" not in node1.stderr, node1.stderr
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.wait(120) == 143, node0.stderr
    assert follower.survivors() == [] and leader.survivors() == []


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
