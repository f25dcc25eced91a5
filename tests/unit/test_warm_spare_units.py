"""--warm-spare and --preload as options, what a spare says of its cost, and which requests a
spare accepts (its life with real processes is tests/test_warm_spare.py's)."""

import os

import pytest

from launcher.cli.launch import options_of
from launcher.cli.sections import config_from_options
from launcher.core.config import GroupSection
from launcher.forked.parked_spare import misfit, warn_of_late_cuda_env
from launcher.grammar.errors import UsageError
from launcher.process.warm_spares import cost_line


def _group(*flags: str) -> GroupSection:
    return config_from_options(options_of([*flags, "--run-dir", "runs", "train.py"]), environ={}).group


def test_a_warm_spare_is_on_by_default_only_with_gpus_and_on_when_asked():
    assert _group().warm_spare is False  # no GPU on this machine: gloo
    assert _group("--warm-spare", "on").warm_spare is True
    assert _group("--warm-spare", "off", "--nproc", "2").warm_spare is False
    assert _group("--no-fork-server").warm_spare is False  # auto: off without the fork server


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--warm-spare", "on", "--no-fork-server"], "--warm-spare on needs the fork server"),
        (["--warm-spare", "on", "--no-python"], "--warm-spare on needs the fork server"),
        (["--preload", "numpy", "--no-fork-server"], "--preload needs the fork server"),
        (["--preload", "numpy,my-lib"], "--preload takes module names (a.b,c), got 'my-lib'"),
        (["--preload", "a..b"], "got 'a..b'"),
    ],
)
def test_a_warm_spare_or_preload_that_cannot_be_had_is_a_usage_error(flags, said):
    with pytest.raises(UsageError) as refused:
        _group(*flags)
    assert said in str(refused.value)


def test_preload_takes_a_comma_list_of_module_names():
    assert _group("--preload", " numpy , transformers.models ,").preload == ("numpy", "transformers.models")
    assert _group().preload == ()


def test_the_cost_of_a_spare_is_said_in_one_line_unknown_where_nvml_cannot_count_it():
    cpu = {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}
    assert cost_line([cpu, cpu]).endswith("2 parked worker(s), one per local rank, forked ahead (no CUDA)")
    gpu = {"device": "cuda:0", "seconds": 0.41, "gpu_bytes": 514 * 2**20, "nccl": ""}
    other = {"device": "cuda:1", "seconds": 0.52, "gpu_bytes": 530 * 2**20, "nccl": ""}
    assert cost_line([gpu]).endswith(
        "CUDA context, cuBLAS handle and NCCL's set-up made ahead in 0.41 s; GPU memory each: 514 MiB"
    )
    assert cost_line([gpu, other]).endswith("in 0.52 s; GPU memory each: 514–530 MiB")
    unknown = {**other, "gpu_bytes": None}
    assert cost_line([gpu, unknown]).endswith("GPU memory each: unknown (NVML could not count it)")
    no_nccl = {**other, "nccl": "RuntimeError: NCCL error"}
    said = cost_line([gpu, no_nccl])
    assert "CUDA context and cuBLAS handle made ahead" in said
    assert said.endswith("(NCCL not set up ahead: RuntimeError: NCCL error)")


def test_a_spare_takes_only_its_own_local_rank_with_the_gpus_it_was_made_for(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    mine = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert misfit(mine, 1) == ""
    assert "local rank 1's spare, asked for local rank 0" in misfit({**mine, "LOCAL_RANK": "0"}, 1)
    assert "made with CUDA_VISIBLE_DEVICES=2,3, asked for 3" in misfit(
        {**mine, "CUDA_VISIBLE_DEVICES": "3"}, 1
    )


def test_a_spare_takes_only_a_rank_with_the_nccl_settings_it_set_nccl_up_with(monkeypatch):
    for name in [n for n in os.environ if n.startswith("NCCL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    mine = {"LOCAL_RANK": "0", "NCCL_SOCKET_IFNAME": "lo"}
    assert misfit(mine, 0) == ""
    other = {**mine, "NCCL_SOCKET_IFNAME": "eth0"}
    assert "made with NCCL_SOCKET_IFNAME=lo, asked for eth0" in misfit(other, 0)
    assert "made with NCCL_DEBUG=None, asked for INFO" in misfit({**mine, "NCCL_DEBUG": "INFO"}, 0)


@pytest.fixture
def environ_hook(monkeypatch):
    """os.environ's setter as it is now, put back after the test (warn_of_late_cuda_env wraps it)."""
    monkeypatch.setattr(os._Environ, "__setitem__", os._Environ.__setitem__)


def test_a_script_that_picks_its_gpus_after_its_spare_made_the_context_is_told_once(
    monkeypatch, capsys, environ_hook
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    warn_of_late_cuda_env({"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": None})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what the context was made with: nothing to say
    monkeypatch.setenv("FTLAUNCH_TEST_OTHER", "1")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    said = capsys.readouterr().err
    assert said.count("ftlaunch:") == 1, said
    assert "CUDA_VISIBLE_DEVICES=1 set by the script changes nothing" in said
    assert "made by its warm spare with CUDA_VISIBLE_DEVICES=0,1" in said and "--warm-spare off" in said


def test_a_script_that_tunes_nccl_after_its_spare_set_nccl_up_is_told_once(monkeypatch, capsys, environ_hook):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    warn_of_late_cuda_env({"CUDA_VISIBLE_DEVICES": None}, {"NCCL_DEBUG": "WARN"})
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # as NCCL read it: nothing to say
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    said = capsys.readouterr().err
    assert said.count("ftlaunch:") == 1, said
    assert "NCCL_IB_DISABLE=1 set by the script may change nothing: NCCL read its settings" in said
