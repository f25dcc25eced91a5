"""Stragglers (issue 52) with real nodes on loopback: 2 nodes × 2 ranks of DDP over gloo, one
rank's own work made twice as long by the script (its batch takes twice as long to come), nothing
marked for ftlaunch but ft.heartbeat. Node 0 names it, with its node, within a minute of the
slowdown, says when it is back, and shows every rank's own work in status and the metrics; the
same job balanced names no one."""

import re
import signal
from pathlib import Path

import pytest
from helpers import SCRIPTS, until
from test_many_nodes import Job, _status_when

from launcher.core.events import OwnWorkNoted, Straggler
from launcher.observe.plot import draw_run, node_events
from launcher.runs.directory import RunDir

pytestmark = pytest.mark.timeout(300)

SLOW = str(SCRIPTS / "slow_rank.py")
WINDOW = ["--straggler-window", "10s"]  # the default 30 s is the bench's (bench_stragglers.py)


def _job(launcher, tmp_path: Path, name: str, *script_args: str) -> Job:
    args = ["--nproc", "2", "--run-name", name, *WINDOW, SLOW, "--out", str(tmp_path), *script_args]
    return Job(launcher, tmp_path, 2, *args)


def _stop(job: Job) -> None:
    """SIGTERM to node 0: every rank stops at one step (ft.should_stop), every node exits 143."""
    job.nodes[0].proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == {0: 143, 1: 143}, job.nodes[0].stderr
    assert job.survivors() == []


def test_a_rank_twice_as_slow_is_named_with_its_node_within_a_minute_and_said_back(launcher, tmp_path):
    job = _job(launcher, tmp_path, "slow", "--slow-rank", "3", "--slow-from", "100", "--slow-steps", "250")
    metrics = tmp_path / "node0.prom"
    job.start(1)
    node0 = job.start(0, "--metrics-file", str(metrics))
    line = node0.read_console_until(lambda text: "behind: rank 3" in text, 150, stream="stderr")
    assert re.search(r"behind: rank 3 on node 1 \(\S+\): its own work \d\.\d× the median", line), line
    assert "every rank waits for it" in line
    named = until(lambda: node0.logged(Straggler), timeout=10)[0]
    slow_since = float((tmp_path / "slow_since").read_text())
    assert named.t_wall - slow_since < 60, named.t_wall - slow_since  # the bound
    assert (named.event.rank, named.event.node, named.event.back) == (3, 1, False)
    assert named.event.ratio >= 1.5

    seen = _status_when(tmp_path, "slow", lambda p: all(r.get("own_work") for r in p["ranks"]), timeout=60)
    assert sorted((r["node"], r["rank"]) for r in seen["progress"]["ranks"]) == [
        (0, 0),
        (0, 1),
        (1, 2),
        (1, 3),
    ]
    prom = until(lambda: "ftlaunch_rank_own_work_ratio{" in metrics.read_text() and metrics.read_text(), 30)
    assert re.search(r'ftlaunch_rank_own_work_ratio\{[^}]*rank="3"[^}]*\} (\d+\.\d+)', prom), prom

    back = node0.read_console_until(
        lambda text: "rank 3 on node 1" in text and "is back" in text, 150, stream="stderr"
    )
    assert "back to speed" in back, back
    assert [e.back for e in node0.events(Straggler)] == [False, True]
    _stop(job)
    assert not any(e.rank != 3 for e in node0.events(Straggler))
    figure = draw_run("slow", node_events(RunDir(str(tmp_path / "runs" / "slow")).read_events(), None))
    assert "straggler/attempt0/rank3" in {patch.get_gid() for patch in figure.axes[0].patches}


def test_the_same_job_balanced_names_no_one(launcher, tmp_path):
    job = _job(launcher, tmp_path, "balanced")
    job.start(1)
    node0 = job.start(0)
    # Evidence that every rank was judged, twice, 15 s apart.
    until(
        lambda: len([e for e in node0.events(OwnWorkNoted) if len(e.ratios) == 4]) >= 3, timeout=150, look=0.5
    )
    _stop(job)
    assert node0.events(Straggler) == [], node0.events(OwnWorkNoted)
    assert "behind: rank" not in node0.stderr
    ratios = [r for e in node0.events(OwnWorkNoted) for r in e.ratios.values()]
    assert max(ratios) < 1.5, ratios


def test_a_rank_made_slow_by_chaos_is_named(launcher, tmp_path):
    """--chaos slow: the rehearsal of a straggler on one's own job, here on one node."""
    launch = launcher.start(
        "--nproc", "2", "--run-name", "chaos", *WINDOW, "--chaos", "slow:rank=1,at=step:30,factor=3",
        SLOW, "--out", str(tmp_path),
    )  # fmt: skip
    launch.read_console_until(
        lambda text: "chaos: asked rank 1" in text and "for slow" in text, 120, stream="stderr"
    )
    line = launch.read_console_until(lambda text: "behind: rank 1" in text, 120, stream="stderr")
    assert re.search(r"behind: rank 1 \(\S+\): its own work \d\.\d× the median", line), line
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.wait(120) == 143, launch.stderr
    assert "never landed" not in launch.stderr
    assert launch.survivors() == []


@pytest.mark.parametrize("culprit", [1, 2, 3])
def test_a_hangs_culprit_on_either_node_is_the_rank_that_never_entered_the_collective(
    launcher, tmp_path, culprit
):
    """Issue 52 item 5: 2 nodes × 2 ranks of DDP; the culprit sleeps before a step's forward while the
    other three enter that step's all_reduce (in DDP's backward, where no Python frame of
    torch.distributed shows) and wait. Before, ranks 2, 0 and 2 were blamed."""
    job = _job(launcher, tmp_path, "hang", "--work", "0.02", "--hang-rank", str(culprit), "--hang-at", "40")
    job.args = ("--heartbeat-timeout", "8s", "--max-failures", "0", *job.args)
    job.start(1)
    node0 = job.start(0)
    codes = job.wait(150)
    assert codes[0] != 0, node0.stderr
    node = culprit // 2
    line = re.search(
        rf"attempt 0: rank {culprit} \(node {node}\) never entered all_reduce #(\d+).*", node0.stderr
    )
    assert line, node0.stderr
    waiting = [r for r in range(4) if r != culprit]
    assert ", ".join(f"{r} (node {r // 2})" for r in waiting[:2]) in line.group(0), line.group(0)
    assert "they wait, they are not hung of their own" in line.group(0)
    assert f"attempt 0: rank {culprit} never" not in node0.stderr  # named with its node, once
    assert job.survivors() == []
