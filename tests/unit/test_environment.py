"""torchrun's PET_* environment, as Kubernetes' operators set it (launcher.cli.environment): read
below FTLAUNCH_* and the command line, torchrun's names mapped to ftlaunch's, and
PET_MASTER_ADDR:PET_MASTER_PORT as where the nodes meet. The variables are those of the
operators' own source:

- Kubeflow Trainer, pkg/runtime/framework/plugins/torch/torch.go (EnforceMLPolicy) and
  pkg/constants/constants.go: PET_NNODES, PET_NPROC_PER_NODE (a number, or auto/cpu/gpu),
  PET_NODE_RANK (the Job's completion index), PET_MASTER_ADDR (``<job>-node-0-0.<job>``) and
  PET_MASTER_PORT (29400, ContainerTrainerPort);
- Kubeflow training-operator, pkg/controller.v1/pytorch/envvar.go and elastic.go: PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK, and with an elastic policy PET_RDZV_ENDPOINT
  (``<job>-worker-0:<port>``), PET_RDZV_BACKEND (c10d), PET_NNODES as MIN:MAX,
  PET_MAX_RESTARTS, PET_RDZV_ID, PET_RDZV_CONF, PET_STANDALONE.

The two-"pod" job launched with Trainer's variables is tests/test_kubernetes.py.
"""

import os

import click
import pytest

from launcher.cli.environment import torchrun_defaults
from launcher.cli.launch import options_of
from launcher.cli.main import main
from launcher.cli.sections import config_from_options
from launcher.grammar.errors import UsageError

TRAINER_NODE_1 = {  # Kubeflow Trainer's five, for node 1 of a TrainJob named "mnist"
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "2",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "mnist-node-0-0.mnist",
    "PET_MASTER_PORT": "29400",
}


@pytest.fixture
def environ(monkeypatch):
    """A clean slate of launcher variables; set what the test needs."""
    for key in list(os.environ):
        if key.startswith(("PET_", "FTLAUNCH_", "SLURM_")):
            monkeypatch.delenv(key)

    def set_all(values):
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_all


def _config(*argv: str):
    return config_from_options(options_of([*argv, "train.py"]), environ={})


def test_kubeflow_trainers_variables_make_a_node_of_a_two_node_job_that_meets_at_the_master(environ):
    environ(TRAINER_NODE_1)
    config = _config()
    assert (config.cluster.nnodes, config.cluster.node_rank, config.group.nproc) == (2, 1, 2)
    assert config.cluster.rdzv_endpoint == "mnist-node-0-0.mnist:29400"
    # The workers' store: on node 0, a port of its own each attempt (the master port is taken).
    assert (config.group.master_addr, config.group.master_port) == ("mnist-node-0-0.mnist", 0)


def test_the_command_line_beats_ftlaunch_variables_which_beat_torchruns(environ):
    environ({**TRAINER_NODE_1, "FTLAUNCH_NPROC": "3"})
    assert _config().group.nproc == 3
    assert _config("--nproc", "4").group.nproc == 4
    environ({"FTLAUNCH_RDZV_ENDPOINT": "10.0.0.1:29500"})
    assert _config().cluster.rdzv_endpoint == "10.0.0.1:29500"
    assert _config("--node-rank", "0").cluster.node_rank == 0


def test_the_pytorchjob_elastic_policy_meets_at_its_endpoint_with_torchruns_restart_count(environ):
    environ(
        {
            "PET_RDZV_ENDPOINT": "mnist-worker-0:23456",
            "PET_RDZV_BACKEND": "c10d",
            "PET_NNODES": "1:3",
            "PET_MAX_RESTARTS": "7",
            "PET_NPROC_PER_NODE": "1",
            "PET_RDZV_ID": "mnist",
            "PET_STANDALONE": "",  # set empty when the policy asks for it: one node needs nothing
            "PET_MONITOR_INTERVAL": "5",  # torchrun's own way of watching: nothing to do here
            "PET_NODE_RANK": "2",
            "PET_MASTER_ADDR": "ignored-master",  # the endpoint given wins
            "PET_MASTER_PORT": "1",
        }
    )
    config = _config()
    assert config.cluster.rdzv_endpoint == "mnist-worker-0:23456"
    assert (config.cluster.min_nodes, config.cluster.nnodes, config.cluster.node_rank) == (1, 3, 2)
    assert (config.restart.max_failures, config.cluster.rdzv_id) == (7, "mnist")


def test_ftlaunchs_own_names_read_as_pet_variables_too_and_win_over_torchruns_names(environ):
    environ({"PET_MAX_RESTARTS": "7", "PET_MAX_FAILURES": "2", "PET_CHECKPOINT_DIR": "/shared/ckpt"})
    config = _config()
    assert config.restart.max_failures == 2
    assert config.group.checkpoint_url == "/shared/ckpt"


def test_a_static_rendezvous_is_ftlaunchs_c10d_and_another_backend_is_refused(environ):
    environ({"PET_RDZV_BACKEND": "static"})
    assert options_of(["train.py"])["rdzv_backend"] == "c10d"
    environ({"PET_RDZV_BACKEND": "etcd-v2"})
    with pytest.raises(UsageError, match="PET_RDZV_BACKEND=etcd-v2: ftlaunch meets through torch's c10d"):
        options_of(["train.py"])


def test_pet_variables_set_only_the_options_ftlaunch_variables_set(environ, capsys):
    """PET_VERSION=1 printed the version and ended the command (a pod's training skipped, exit 0),
    and PET_SCRIPT named the script: PET_* now reaches what FTLAUNCH_* does, nothing more."""
    environ({"PET_VERSION": "1", "PET_HELP": "1", "PET_SCRIPT": "other.py", "PET_SCRIPT_ARGS": "--x"})
    options = options_of(["train.py"])
    assert (options["script"], options["script_args"]) == ("train.py", ())
    assert capsys.readouterr().out == ""
    with pytest.raises(click.MissingParameter):
        options_of([])


def test_torchruns_words_for_the_number_of_workers(environ):
    environ({"PET_NPROC_PER_NODE": "cpu"})
    assert _config().group.nproc == os.cpu_count()
    environ({"PET_NPROC_PER_NODE": "auto"})
    assert _config().group.nproc == 1  # no GPU here: ftlaunch's auto
    environ({"PET_NPROC_PER_NODE": "gpu"})
    with pytest.raises(UsageError, match="--nproc gpu: this node sees no GPU"):
        _config()


def test_one_node_ignores_the_master_address_and_nothing_set_means_nothing_read(environ):
    environ({"PET_NNODES": "1", "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29400"})
    config = _config()
    assert (config.cluster.nnodes, config.cluster.rdzv_endpoint) == (1, "")
    assert torchrun_defaults({}, ["nproc", "nnodes"]) == {}


def test_the_metrics_options_read_ftlaunch_and_pet_variables_like_every_option(environ):
    environ({"PET_METRICS_PORT": "9400"})
    assert _config().metrics.port == 9400
    environ({"FTLAUNCH_METRICS_PORT": "9500", "FTLAUNCH_METRICS_FILE": "/tmp/m.prom"})
    config = _config()
    assert (config.metrics.port, str(config.metrics.file)) == (9500, "/tmp/m.prom")


def test_a_pytorchjobs_endpoint_without_a_port_takes_torchruns_default(environ):
    environ({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_ENDPOINT": "job-worker-0"})
    assert _config().cluster.rdzv_endpoint == "job-worker-0:29400"


@pytest.mark.parametrize(
    "variables, argv, said",
    [
        # Issue 48.6b: click's own conversions named only the option.
        ({"PET_NODE_RANK": "x"}, [], "'x' is not a whole number (--node-rank came from PET_NODE_RANK=x)"),
        (
            {"PET_MAX_RESTARTS": "abc"},
            [],
            "'abc' is not a whole number (--max-failures came from PET_MAX_RESTARTS=abc)",
        ),
        (
            {"FTLAUNCH_MAX_FAILURES": "abc"},
            [],
            "'abc' is not a whole number (--max-failures came from FTLAUNCH_MAX_FAILURES=abc)",
        ),
        # ftlaunch's own checks, after parsing: one line, which said nothing of the variable (the
        # banner of PET_* options came before it).
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "5", "PET_MASTER_ADDR": "10.0.0.1", "PET_MASTER_PORT": "1"},
            [],
            "--node-rank must be in 0..1, got 5 (--node-rank came from PET_NODE_RANK=5)\n",
        ),
        (
            {"PET_NNODES": "2", "PET_MASTER_ADDR": "10.0.0.1", "PET_MASTER_PORT": "29500"},
            ["--master-port", "29500"],
            "(--rdzv-endpoint came from PET_MASTER_ADDR=10.0.0.1 and PET_MASTER_PORT=29500)",
        ),
        ({"FTLAUNCH_MODULE": "1"}, ["--no-python"], "each other (--module came from FTLAUNCH_MODULE=1)"),
        # The command line's own value is not the environment's, whatever the environment holds.
        ({"PET_MAX_RESTARTS": "abc"}, ["--max-failures", "2", "--nproc", "x"], "got 'x'\n"),
    ],
)
def test_a_refused_value_from_the_environment_names_its_variable(environ, capsys, variables, argv, said):
    environ(variables)
    assert main([*argv, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ftlaunch: error: ") and said in err, err


@pytest.mark.parametrize("prefix", ["FTLAUNCH_", "PET_"])
def test_an_empty_variable_is_unset_under_either_prefix(environ, prefix):
    """``PET_RUN_DIR=`` put the runs in the current folder and ``PET_RUN_ID=`` named nothing,
    where ``FTLAUNCH_RUN_DIR=`` (click) left the default: both prefixes now read an empty variable
    as unset, and the option takes its default (or the other prefix's value)."""
    plain = _config()
    environ({f"{prefix}RUN_DIR": "", f"{prefix}RUN_ID": "", f"{prefix}RDZV_ID": "", f"{prefix}NNODES": ""})
    config = _config()
    assert (config.run.url, config.run.run_id, config.cluster.rdzv_id) == (
        plain.run.url,
        plain.run.run_id,
        "",
    )
    assert config.cluster.nnodes == 1
    environ({"FTLAUNCH_RUN_ID": "", "PET_RUN_ID": "from-pet"})
    assert _config().run.run_id == "from-pet"


def test_an_empty_torchrun_name_is_unset_too(environ):
    environ({"PET_NPROC_PER_NODE": "", "PET_MAX_RESTARTS": "", "PET_RDZV_BACKEND": ""})
    assert torchrun_defaults(os.environ, ["nproc", "max_failures", "rdzv_backend"]) == {}
