"""scripts/bench_standby.py (issue 50 item 3), each arm once, for real: a training node's tree
SIGKILLed, the job back at full size, where rank 2 went, every launcher's exit, nothing left.
The figures themselves are docs/benchmarks.md's; these check that the bench measures what it
says. The standby arm runs once ftlaunch takes --standby-nodes."""

import os
import sys

import pytest
from helpers import MARKER, ROOT, _wait_for_none

sys.path.insert(0, str(ROOT / "scripts"))
import bench_standby as bench  # noqa: E402

# Three or four launchers that import torch, a 5 s node timeout, a 10 s relaunch: about 25 s on
# a quiet machine, several times that under the suite. A hang guard, not a measure of speed.
pytestmark = pytest.mark.timeout(300)


def _run(arm: str, tmp_path) -> bench.Run:
    """One run of ``arm``; fails the test if any process it started outlives it."""
    marker = f"bench-standby-{arm}-{os.getpid()}"
    run = bench.run_arm(arm, tmp_path / arm, bench.bench_env({**os.environ, MARKER: marker}))
    left = _wait_for_none(marker, 10)
    assert not left, f"processes survived the run: {left}"
    return run


def _phases_add_up(run: bench.Run) -> None:
    """Every phase logged, none negative, together the whole figure."""
    assert list(run.phases) == bench.PHASES and min(run.phases.values()) >= 0, run.phases
    assert run.total is not None and abs(sum(run.phases.values()) - run.total) < 1e-6, run


def test_no_standby_is_back_at_full_size_only_after_the_relaunch(tmp_path):
    run = _run("relaunch", tmp_path)
    assert run.total is not None, run.note
    assert (run.victim, run.rank2_node, run.rank2_group) == (2, 2, 2)
    assert run.codes == {0: 0, 1: 0, 2: 0}, run
    # Full size needs node 2 back: a figure taken from the old group's steps would be smaller.
    assert run.phases["lost"] + run.phases["met"] > bench.RELAUNCH_AFTER_S, run.phases
    _phases_add_up(run)


def test_torchrun_lets_its_fourth_agent_in_for_the_killed_one(tmp_path):
    run = _run("torchrun", tmp_path)
    assert run.total is not None, run.note
    assert run.victim not in (None, 0) and run.rank2_node != run.victim, run
    assert sorted(run.codes) == sorted({0, 1, 2, 3} - {run.victim}) and set(run.codes.values()) == {0}, run


def test_a_standby_takes_the_killed_nodes_position(tmp_path):
    assert bench.has_standby_option()  # ftlaunch has --standby-nodes: the arm runs, never skipped
    run = _run("standby", tmp_path)
    assert run.total is not None, run.note
    assert (run.victim, run.rank2_node, run.rank2_group) == (2, 3, 2), run
    assert run.codes == {0: 0, 1: 0, 3: 0}, run
    _phases_add_up(run)
