"""--standby-nodes (issue 50) without processes: the options, SLURM's node count, who trains at
which position (``place_nodes``), and the plan every node checks before it starts or stands by."""

import pytest
from test_slurm_units import STEP, _options

from launcher.cli.sections import config_from_options
from launcher.cluster.wire import RoundPlan, plan_problem
from launcher.core.layout import Layout, place_nodes
from launcher.grammar.errors import UsageError


def _cluster(*flags: str, environ=None):
    return config_from_options(_options(*flags), environ=environ or {}).cluster


def test_standby_nodes_widen_the_node_ranks_and_under_srun_come_out_of_the_step(monkeypatch):
    cluster = _cluster("--nnodes", "3", "--standby-nodes", "1", "--node-rank", "3", "--rdzv-endpoint", "h:1")
    assert (cluster.nnodes, cluster.standby, cluster.members, cluster.node_rank) == (3, 1, 4, 3)
    monkeypatch.setenv("PATH", "/nonexistent")
    under_srun = _cluster("--standby-nodes", "1", environ=STEP)  # 3 nodes in the step: 2 train
    assert (under_srun.nnodes, under_srun.members, under_srun.node_rank) == (2, 3, 2)
    monkeypatch.setenv("FTLAUNCH_STANDBY_NODES", "1")
    assert _cluster(environ=STEP) == under_srun


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "3", "--standby-nodes", "1", "--node-rank", "4"], r"--node-rank must be in 0\.\.3 \("),
        (["--nnodes", "1", "--standby-nodes", "1"], "needs --nnodes 2 or more: node 0 always trains"),
        (["--nnodes", "2", "--standby-nodes", "-1"], "--standby-nodes"),
        (["--nnodes", "2", "--standby-nodes", "16383"], "at most 16384 nodes in all"),
    ],
)
def test_bad_standby_options_are_usage_errors(flags, message):
    with pytest.raises(UsageError, match=message):
        _cluster(*flags, "--rdzv-endpoint", "h:1")


def test_a_step_with_no_node_left_to_train_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="leaves no training node of the step's 3 node"):
        _cluster("--standby-nodes", "3", environ=STEP)


def test_the_lowest_node_ranks_train_at_the_start():
    placed = place_nodes([3, 0, 2, 1], {}, 3)
    assert (placed.nodes, placed.standby, placed.took) == ((0, 1, 2), (3,), ())


def test_a_standby_takes_the_lost_nodes_position_and_the_others_keep_theirs():
    placed = place_nodes([0, 1, 3], {0: 0, 1: 1, 2: 2}, 3)
    assert (placed.nodes, placed.standby, placed.took) == ((0, 1, 3), (), ((2, 3, 2),))
    layout = Layout(placed.nodes, 3, nproc=4)
    assert (layout.group_rank, layout.rank(0), layout.world_size) == (2, 8, 12)


def test_a_node_back_stands_by_and_never_displaces_one_that_trains():
    placed = place_nodes([0, 1, 2, 3], {0: 0, 1: 1, 3: 2}, 3)
    assert (placed.nodes, placed.standby, placed.took) == ((0, 1, 3), (2,), ())


def test_two_lost_with_one_standby_fill_the_lowest_free_position_first():
    placed = place_nodes([0, 3, 4], {0: 0, 1: 1, 2: 2}, 3)  # an elastic job could not shrink here
    assert placed.nodes == (0, 3, 4) and placed.took == ((1, 3, 1), (2, 4, 2))
    shrunk = place_nodes([0, 2], {0: 0, 1: 1, 2: 2}, 2)  # elastic, no standby left: it shrinks
    assert (shrunk.nodes, shrunk.standby) == ((0, 2), ())


def test_a_standby_has_no_rank():
    layout = Layout((0, 1, 2), 3, nproc=1, standby=(3,))
    assert not layout.trains
    with pytest.raises(ValueError, match="stands by"):
        layout.rank(0)
    assert "node(s) 3 standing by" in layout.describe()
    with pytest.raises(ValueError, match="both train and stand by"):
        Layout((0, 1), 1, nproc=1, standby=(1,))


@pytest.mark.parametrize(
    "plan, node, problem",
    [
        (RoundPlan(3, "a", 1, [0, 1, 3], world_size=3, standby=[2]), 2, ""),
        (RoundPlan(3, "a", 1, [0, 1, 3], world_size=3, standby=[2]), 3, ""),
        (RoundPlan(3, "a", 1, [0, 1, 3], world_size=3, standby=[]), 2, "leaves out node 2"),
        (RoundPlan(3, "a", 1, [0, 1, 4], world_size=3, standby=[2]), 2, "names impossible nodes"),
        (RoundPlan(3, "a", 1, [1, 0, 3], world_size=3, standby=[2]), 2, "names impossible nodes"),
        (RoundPlan(3, "a", 1, [0, 1], world_size=2, standby=[2, 3]), 2, "standing by [2, 3]"),
        (RoundPlan(3, "a", 1, [0, 1, 2, 3], world_size=4), 2, "standing by []"),
    ],
)
def test_every_node_checks_the_positions_and_standbys_of_node_0s_plan(plan, node, problem):
    found = plan_problem(plan, node=node, nproc=1, fewest=3, nnodes=3, standby=1)
    assert (problem in found and bool(found)) if problem else found == ""


def test_without_standby_nodes_a_plan_with_a_standby_is_refused():
    plan = RoundPlan(3, "a", 1, [0, 1], world_size=2, standby=[2])
    assert "names impossible nodes" in plan_problem(plan, node=1, nproc=1, fewest=2, nnodes=2)
