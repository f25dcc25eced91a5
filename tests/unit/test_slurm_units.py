"""What ftlaunch reads from a SLURM step's environment (pure parsing; the real SLURM is elsewhere)."""

import pytest

from launcher.cli.launch import options_of
from launcher.cli.sections import config_from_options
from launcher.grammar.errors import UsageError
from launcher.grammar.slurm import expand_hostlist
from launcher.grammar.slurm import read_slurm_step as slurm_step


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[001-003,010],cpu7", ["gpu001", "gpu002", "gpu003", "gpu010", "cpu7"]),
        ("a[1-2],b", ["a1", "a2", "b"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("x-[9-11]", ["x-9", "x-10", "x-11"]),
    ],
)
def test_host_lists_expand_as_scontrol_does(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-", "gpu[a-b]", "gpu[3-1]", "gpu]1["])
def test_a_host_list_that_cannot_be_read_is_a_usage_error(bad):
    with pytest.raises(UsageError):
        expand_hostlist(bad)


STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_PROCID": "2",
    "SLURM_STEP_NODELIST": "gpu[007-009]",
}


def test_an_srun_step_gives_the_node_count_rank_endpoint_and_job(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # our own reading, not scontrol's
    step = slurm_step(STEP)
    assert (step.nnodes, step.node_rank, step.first_host, step.job_id) == (3, 2, "gpu007", "4242")
    assert step.rdzv_endpoint == "gpu007:29642"


def test_outside_a_step_slurm_is_not_read():
    assert slurm_step({}) is None
    batch_shell = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu[007-009]"}
    assert slurm_step(batch_shell) is None  # the batch script itself runs on one node


def test_more_than_one_task_per_node_is_refused():
    with pytest.raises(UsageError, match="--ntasks-per-node=1"):
        slurm_step({**STEP, "SLURM_STEP_NUM_TASKS": "24"})


def _options(*flags: str) -> dict:
    """The command's parameters for ``ftlaunch FLAGS train.py --lr 1``, as click parses them."""
    return options_of([*flags, "--run-dir", "runs", "train.py", "--lr", "1"])


def test_under_srun_no_flag_is_needed(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    config = config_from_options(_options(), environ=STEP)
    assert (config.cluster.nnodes, config.cluster.node_rank, config.cluster.rdzv_endpoint) == (
        3,
        2,
        "gpu007:29642",
    )
    assert config.run.name == "train-job4242"  # stable across requeues of the job
    assert config.group.master_addr == "gpu007" and str(config.group.log_dir).endswith("logs/node2")
    explicit = config_from_options(_options("--nnodes", "1", "--run-name", "mine"), environ=STEP)
    assert explicit.cluster.nnodes == 1 and explicit.run.name == "mine"  # flags win over SLURM


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2"], "--rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:"], "--rdzv-endpoint HOST:PORT .*, got 'h:'"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:99999"], "got 'h:99999'"),
        (
            ["--nnodes", "3:2", "--rdzv-endpoint", "h:1"],
            r"--nnodes 3:2: MIN must be at least 1 and at most MAX",
        ),
        (["--nnodes", "0:2", "--rdzv-endpoint", "h:1"], r"--nnodes 0:2: MIN must be at least 1"),
        (["--nnodes", "-1:2", "--rdzv-endpoint", "h:1"], r"MIN must be at least 1"),
        (["--nnodes", "a:b"], r"--nnodes takes N or MIN:MAX \(whole numbers\), got 'a:b'"),
        (["--nnodes", "2:"], r"--nnodes takes N or MIN:MAX"),
        (["--nnodes", "1:2:3"], r"--nnodes takes N or MIN:MAX"),
        (["--nnodes", "1:4"], "--nnodes 1:4 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in 0..1"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in 0..1"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "color=red"], "--rdzv-conf takes"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--join-timeout", "0"], "--join-timeout"),
    ],
)
def test_bad_node_options_are_usage_errors(flags, message):
    with pytest.raises(UsageError, match=message):
        config_from_options(_options(*flags), environ={})


@pytest.mark.parametrize(
    "given, endpoint, master_addr",
    [
        ("10.0.0.1", "10.0.0.1:29400", "10.0.0.1"),
        ("node-0.job", "node-0.job:29400", "node-0.job"),
        ("[fe80::1]", "[fe80::1]:29400", "fe80::1"),
        ("10.0.0.1:1234", "10.0.0.1:1234", "10.0.0.1"),
        ("[fe80::1]:1234", "[fe80::1]:1234", "fe80::1"),
    ],
)
def test_an_endpoint_without_a_port_takes_torchruns_default_29400(given, endpoint, master_addr):
    config = config_from_options(_options("--nnodes", "2", "--rdzv-endpoint", given), environ={})
    assert (config.cluster.rdzv_endpoint, config.group.master_addr) == (endpoint, master_addr)


@pytest.mark.parametrize(
    "value, fewest, most, elastic",
    [("2:3", 2, 3, True), ("1:4", 1, 4, True), ("3:3", 3, 3, False), ("3", 3, 3, False)],
)
def test_nnodes_takes_a_range_for_elastic_membership(value, fewest, most, elastic, monkeypatch):
    """--nnodes MIN:MAX, or FTLAUNCH_NNODES (issue 25.1); MIN = MAX is a fixed count."""
    config = config_from_options(_options("--nnodes", value, "--rdzv-endpoint", "h:1"), environ={})
    cluster = config.cluster
    assert (cluster.fewest, cluster.nnodes, cluster.elastic) == (fewest, most, elastic)
    assert config.world_size == most * config.group.nproc  # the full job's
    monkeypatch.setenv("FTLAUNCH_NNODES", value)
    assert config_from_options(_options("--rdzv-endpoint", "h:1"), environ={}).cluster == cluster


def test_a_slurm_node_list_too_large_to_be_real_is_refused_before_it_is_expanded():
    with pytest.raises(UsageError, match="names more than 1048576 hosts"):
        expand_hostlist("n[0-99999999999]")
    with pytest.raises(UsageError, match="names more than 1048576 hosts"):
        expand_hostlist("r[1-2000]n[1-2000]")  # each range small, their product not
    assert len(expand_hostlist("n[1-1000]")) == 1000
