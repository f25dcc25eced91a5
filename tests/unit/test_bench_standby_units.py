"""scripts/bench_standby.py's reading of the workers' stamps and of the bound, without processes:
the figure ends at a step of processes started after the kill, on every rank."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_standby as bench  # noqa: E402

KILL = 100.0


def _stamp(out: Path, what: str, rank: int, pid: int, node: int, t: float, group=None) -> None:
    group = rank if group is None else group
    (out / f"{what}.rank_{rank}.group_{group}.pid_{pid}.node_{node}").write_text(repr(t))


def _warm_job(out: Path) -> None:
    """Three ranks that stepped long before the kill, and a half-written stamp."""
    for rank in range(3):
        _stamp(out, "first_step", rank, 10 + rank, rank, 5.0)
        _stamp(out, "warm", rank, 10 + rank, rank, 50.0)
    (out / "first_step.rank_0.group_0.pid_9.node_0.tmp").write_text("")


def test_steps_of_processes_that_ran_before_the_kill_never_count(tmp_path):
    _warm_job(tmp_path)
    _stamp(tmp_path, "first_step", 0, 20, 0, 101.0)
    _stamp(tmp_path, "first_step", 1, 21, 1, 102.0)
    assert bench.full_size_after(bench.read_stamps(tmp_path), KILL) is None  # rank 2 has not stepped
    _stamp(tmp_path, "first_step", 2, 23, 3, 104.5, group=2)
    _stamp(tmp_path, "first_step", 2, 24, 3, 109.0, group=2)  # a later attempt's: not the first
    done = bench.full_size_after(bench.read_stamps(tmp_path), KILL)
    assert (done.rank, done.node, done.group, done.t) == (2, 3, 2, 104.5)
    assert bench.first_after(bench.read_stamps(tmp_path), KILL, 2).pid == 23


def test_the_bound_is_said_for_every_run_and_when_it_was_not_measured():
    runs = [bench.Run(total=6.1), bench.Run(total=7.9)]
    assert "holds (2 of 2 runs within it; slowest 7.90 s)" in bench.bound_line(runs, "")
    late = bench.bound_line([*runs, bench.Run(total=8.2)], "")
    assert "does NOT hold (2 of 3 runs within it; slowest 8.20 s)" in late
    lost = bench.bound_line([*runs, bench.Run(note="no first step at full size")], "")
    assert "does NOT hold (2 of 3" in lost  # a run that never recovered is no run within it
    assert bench.bound_line(None, "ftlaunch has no --standby-nodes yet").endswith(
        "not measured (ftlaunch has no --standby-nodes yet)"
    )


def _log(logs: Path, node: int, *events) -> None:
    (logs / f"node{node}").mkdir(parents=True)
    lines = [json.dumps({"event": kind, "t_mono": t, **fields}) for kind, t, fields in events]
    (logs / f"node{node}" / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_ftlaunch_phases_end_at_node_0s_decision_and_round_and_the_last_node_running(tmp_path):
    running = {"new": "RUNNING"}
    _log(tmp_path, 0, ("nodes_met", 90.0, {}), ("transition", 90.1, running), ("decision", 105.0, {}),
         ("nodes_met", 106.0, {}), ("transition", 106.2, running))  # fmt: skip
    _log(tmp_path, 1, ("transition", 90.1, running), ("transition", 106.5, running))
    _log(tmp_path, 2, ("transition", 90.2, running))  # the killed node: nothing after the kill
    _log(tmp_path, 3, ("transition", 106.4, running))  # a standby in its place
    phases = bench.ftlaunch_phases(tmp_path, KILL, 107.0)
    assert phases == pytest.approx({"lost": 5.0, "met": 1.0, "spawn": 0.5, "first step": 0.5})
    (tmp_path / "node0" / "events.jsonl").write_text(json.dumps({"event": "decision", "t_mono": 105.0}))
    assert bench.ftlaunch_phases(tmp_path, KILL, 107.0) == pytest.approx({"lost": 5.0})  # never met
