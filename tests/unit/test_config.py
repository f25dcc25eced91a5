"""LaunchConfig's derived values, and the values it refuses."""

import tempfile
from pathlib import Path

import pytest

from launcher.cli.launch import options_of
from launcher.cli.sections import config_from_options
from launcher.core.config import EntryKind, default_run_name
from launcher.grammar.errors import UsageError
from worker_lib.checkpoint.directory import node_cache_root
from worker_lib.checkpoint.manager import CheckpointError


def test_a_script_whose_name_has_spaces_gets_a_plain_run_name():
    name = default_run_name(EntryKind.SCRIPT, "/data/my train script.py", ["--lr", "1"])
    assert name.startswith("my_train_script-") and " " not in name and "/" not in name


def test_the_same_command_names_the_same_run_and_other_arguments_another():
    a = default_run_name(EntryKind.MODULE, "pkg.train", ["--lr", "1"])
    assert a == default_run_name(EntryKind.MODULE, "pkg.train", ["--lr", "1"]) and a.startswith("train-")
    assert a != default_run_name(EntryKind.MODULE, "pkg.train", ["--lr", "2"])


def _config(*argv: str):
    return config_from_options(options_of([*argv, "train.py"]), environ={})


def test_the_longest_run_name_is_the_longest_whose_folders_can_be_made(tmp_path, monkeypatch):
    """The limit is the paths' own: at 246 bytes the run's folder and worker_lib's node cache (whose
    folder is the run id, the name and a hash) can be made; at 247 the cache's cannot."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where worker_lib's node cache goes
    longest = _config("--run-dir", str(tmp_path / "runs"), "--run-name", "a" * 246).run
    (node_cache_root(longest.run_id) / "attempt_0").mkdir(parents=True)
    Path(longest.url, "logs").mkdir(parents=True)
    with pytest.raises(OSError, match="File name too long"):
        (node_cache_root(longest.run_id + "x")).mkdir()
    with pytest.raises(UsageError, match=r"^--run-name is 247 bytes long, at most 246: the run id"):
        _config("--run-name", "a" * 247)


def test_a_run_name_or_id_too_long_for_a_folder_is_refused_in_bytes():
    with pytest.raises(UsageError, match=r"^--run-name is 256 bytes long, at most 255: it names the run"):
        _config("--run-name", "a" * 256, "--run-id", "short")
    with pytest.raises(UsageError, match=r"^--run-id is 256 bytes long, at most 255: it names the node's"):
        _config("--run-id", "b" * 256)
    with pytest.raises(UsageError, match=r"^--run-name is 248 bytes long, at most 246"):
        _config("--run-name", "é" * 124)  # 124 characters, two bytes each


def test_an_empty_run_name_is_refused_not_taken_for_the_default():
    with pytest.raises(UsageError, match=r"^--run-name is empty: give it a value, or leave the option out"):
        _config("--run-name", "")


def test_two_of_ftlaunchs_own_ports_on_one_node_are_refused():
    """Issue 48.3: the second server could never listen (the workers' store failed at the first
    attempt, after 'run ...: new'). Node 0 opens the metrics server, the workers' store and the
    job's store; a follower only its metrics server."""
    with pytest.raises(UsageError, match=r"^--metrics-port and --master-port both name port 29611"):
        _config("--metrics-port", "29611", "--master-port", "29611")
    node_0 = ["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"]  # torchrun's default port: 29400
    with pytest.raises(UsageError, match=r"^--master-port and --rdzv-endpoint both name port 29400"):
        _config(*node_0, "--master-port", "29400")
    with pytest.raises(UsageError, match=r"^--metrics-port and --rdzv-endpoint both name port 29400"):
        _config(*node_0, "--metrics-port", "29400")
    follower = _config(*node_0, "--node-rank", "1", "--metrics-port", "29400", "--master-port", "29400")
    assert follower.listens_on == (("--metrics-port", 29400),)
    assert _config("--metrics-port", "0", "--master-port", "0").listens_on == ()  # the OS's picks


def test_a_lease_is_finite_positive_and_at_most_a_week():
    """--lease 1e300 was taken, and its lock printed a 300-digit age to the next launch."""
    assert _config("--lease", "7d").run.lease == 7 * 86400
    for value in ("1e300", "8d", "0"):
        with pytest.raises(UsageError, match=r"^--lease must be more than 0 seconds and at most 7d"):
            _config("--lease", value)


@pytest.mark.parametrize(
    "option", ["--run-id", "--rdzv-id", "--run-dir", "--log-dir", "--checkpoint-dir", "--nproc"]
)
@pytest.mark.parametrize("form", ["apart", "joined"])
def test_an_empty_value_on_the_command_line_is_refused_not_taken_for_the_default(option, form):
    """``--run-id "$ID"`` with ID unset named the default run id (a Path option made '.' of it):
    refused, one line, whichever option, as ``--run-id=`` too."""
    argv = [option, ""] if form == "apart" else [f"{option}="]
    with pytest.raises(UsageError, match=rf"^{option} is empty: give it a value, or leave the option out"):
        _config(*argv)


def test_an_option_whose_default_is_empty_takes_an_empty_value():
    assert _config("--preload", "").group.preload == ()


@pytest.mark.parametrize("run_id", ["..", ".", "a/b", "../../home", "/abs"])
def test_a_run_id_that_is_no_plain_folder_name_is_refused(run_id):
    """``--run-id ..`` with a checkpoint dir made rank 0's ft.shutdown() remove the node cache
    <tmp>/ftlaunch-cache-<uid>/.., the whole temp dir (break-48): the id names that folder."""
    with pytest.raises(UsageError, match=r"^--run-id must be a plain folder name \(no '/'"):
        _config("--run-id", run_id)


def test_a_run_id_with_spaces_or_dots_inside_is_taken():
    """torchrun takes any id; only what would leave the cache's folder is refused."""
    assert _config("--run-id", "job 7..b").run.run_id == "job 7..b"


@pytest.mark.parametrize("run_id", ["..", ".", "a/../..", ""])
def test_worker_libs_node_cache_refuses_an_id_that_leaves_its_folder(run_id, tmp_path, monkeypatch):
    """Under torchrun (--rdzv-id ..) no check of ours ran before a rank removed the cache."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(CheckpointError, match="run id .* names no folder"):
        node_cache_root(run_id)


def test_the_straggler_options_take_sane_values_or_off():
    config = _config("--straggler-factor", "2", "--straggler-window", "1m")
    assert (config.hangs.straggler_factor, config.hangs.straggler_window) == (2.0, 60.0)
    assert _config("--straggler-factor", "OFF").hangs.straggler_factor is None
    assert _config().hangs.straggler_factor == 1.5 and _config().hangs.straggler_window == 30.0
    for value in ("1", "0.5", "-2", "nan", "inf", "1e300", "1001"):
        with pytest.raises(UsageError, match=r"^--straggler-factor must be"):
            _config("--straggler-factor", value)
    with pytest.raises(
        UsageError, match=r"^--straggler-factor must be a number more than 1, or off, got 'fast'"
    ):
        _config("--straggler-factor", "fast")
    for value in ("0.5s", "0", "8d"):
        with pytest.raises(UsageError, match=r"^--straggler-window must be 1 s to 7d"):
            _config("--straggler-window", value)
