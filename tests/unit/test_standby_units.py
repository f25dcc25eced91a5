"""--standby-nodes (issue 50) without processes: the options, SLURM's node count, who trains at
which position (``place_nodes``), and the plan every node checks before it starts or stands by."""

import pytest
from test_slurm_units import STEP, _options

from launcher.cli.sections import config_from_options
from launcher.cluster.wire import NodeInfo, RoundPlan, plan_problem
from launcher.core.config import ClusterSection
from launcher.core.failures import NodeLostFailure, ProcessFailure, sure_blame
from launcher.core.layout import Layout, place_nodes
from launcher.core.outcomes import AttemptOutcome
from launcher.core.policy import AttemptRecord, RestartPolicy
from launcher.grammar.errors import UsageError
from launcher.roles.membership import Membership


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
    assert (shrunk.nodes, shrunk.standby, shrunk.took) == ((0, 2), (), ())  # node 2 moved, took nothing


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


def _crash(node: int, at: float, signalled: bool = False) -> ProcessFailure:
    return ProcessFailure(
        rank=node, local_rank=0, pid=node, exitcode=-9 if signalled else 1, observed_at=at, node=node
    )


def test_a_blame_is_sure_when_the_clocks_and_node_0s_store_name_one_node():
    died, broken = _crash(2, 10.0, signalled=True), _crash(0, 10.02)
    assert sure_blame([died, broken], first_to_tell=2) == 2
    # The clocks say node 2, node 0's store says node 0 told first: clocks drifted, unsure.
    assert sure_blame([died, broken], first_to_tell=0) is None
    assert sure_blame([died, broken], first_to_tell=None) is None  # no failure interrupt at all
    lost = NodeLostFailure(node=1, host="h", pid=1, silent_for=5.0, observed_at=9.0)
    assert sure_blame([lost, died], first_to_tell=1) is None  # a lost node is no bad node
    assert sure_blame([], first_to_tell=2) is None


def _failed(attempt: int, at: float, node) -> AttemptRecord:
    return AttemptRecord(attempt, AttemptOutcome.FAILED, at, blamed_node=node)


def test_a_node_is_excluded_once_surely_blamed_for_k_failures_in_the_window():
    policy = RestartPolicy(max_failures=-1, failure_window=100.0, exclude_after=2)
    once = [_failed(0, 10.0, 2)]
    assert policy.node_to_exclude(once, now=11.0) is None
    twice = once + [_failed(1, 20.0, 2)]
    assert policy.node_to_exclude(twice, now=21.0) == (2, 2)
    assert policy.node_to_exclude(twice, now=115.0) is None  # the first one fell out of the window
    unsure = twice[:1] + [_failed(1, 20.0, None)]
    assert policy.node_to_exclude(unsure, now=21.0) is None  # never on an unsure blame
    other = once + [_failed(1, 20.0, 1)]
    assert policy.node_to_exclude(other, now=21.0) is None
    assert RestartPolicy(exclude_after=0).node_to_exclude(twice, now=21.0) is None  # never
    with pytest.raises(UsageError, match="--exclude-after must be 0"):
        RestartPolicy(exclude_after=-1)


def test_exclude_after_defaults_to_two_with_standby_nodes_and_to_never_without():
    def policy(*flags):
        return config_from_options(_options(*flags, "--rdzv-endpoint", "h:1"), environ={}).restart

    assert policy("--nnodes", "3", "--standby-nodes", "1").exclude_after == 2
    assert policy("--nnodes", "3").exclude_after == 0
    assert policy("--nnodes", "3", "--exclude-after", "5").exclude_after == 5


def test_a_node_started_with_other_standby_nodes_is_refused():
    cluster = ClusterSection(nnodes=3, standby=1, rdzv_endpoint="h:1")
    job = Membership(cluster, nproc=1, command=("python", "train.py"), run_id="r", grace_period=5.0)
    same = NodeInfo(1, "host", 7, 1, ["python", "train.py"], standby=1)
    other = NodeInfo(2, "host", 8, 1, ["python", "train.py"], standby=0)
    assert job.disagreement({1: same}) == ""
    assert job.disagreement({1: same, 2: other}) == (
        "node 2 (host) runs --standby-nodes 0, node 0 runs --standby-nodes 1"
    )
