"""The adapters' pure parts: which rank uploads which of a framework's files, the metrics kept,
the Lightning callback's base class for either package name, and the check that a framework
placed the ranks where ftlaunch did."""

import importlib
import math
import re
import sys

import pytest
import torch

from worker_lib.integrations import _common
from worker_lib.integrations._common import check_placement, finite_metrics, is_own, keep_own_files

TRAINER_RNG = re.compile(r"rng_state_(\d+)\.pth")


@pytest.mark.parametrize(
    "name, owner",
    [
        ("model.safetensors", 0),
        ("optimizer.pt", 0),
        ("rng_state_0.pth", 0),
        ("rng_state_1.pth", 1),
        ("rng_state_12.pth", 12),
        ("sub/rng_state_3.pth", 3),
        ("rng_state.pth", 0),  # a single rank's
        ("xrng_state_1.pth", 0),  # not the pattern: a shared file
    ],
)
def test_each_file_has_one_uploading_rank(name, owner):
    assert [rank for rank in range(16) if is_own(name, rank, TRAINER_RNG)] == [owner]


def test_a_rank_keeps_only_what_it_uploads(tmp_path):
    for name in ("model.safetensors", "scaler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        (tmp_path / name).write_text(name)
    keep_own_files(str(tmp_path), 1, TRAINER_RNG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rng_state_1.pth"]


def test_only_finite_scalars_become_metrics():
    values = {"loss": torch.tensor(0.5), "lr": 1e-3, "nan": math.nan, "inf": torch.tensor(math.inf)}
    values.update({"many": torch.ones(3), "name": "x", "none": None, "epoch": 2})
    assert finite_metrics(values) == {"loss": 0.5, "lr": 1e-3, "epoch": 2.0}


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_the_lightning_callback_is_built_on_the_package_the_script_imported(package, monkeypatch):
    imported = importlib.import_module(package)
    for other in {"lightning.pytorch", "pytorch_lightning"} - {package}:
        monkeypatch.delitem(sys.modules, other, raising=False)
    monkeypatch.delitem(sys.modules, "worker_lib.integrations.lightning", raising=False)
    adapter = importlib.import_module("worker_lib.integrations.lightning")
    assert issubclass(adapter.FaultTolerance, imported.Callback)


def test_the_trainer_callback_refuses_a_jit_checkpoint(tmp_path):
    """The Trainer's own preemption save (a timer per rank at SIGTERM) would fight the agreed stop."""
    from transformers import TrainingArguments

    import worker_lib as ft
    from worker_lib.integrations.transformers import FaultTolerance

    ft.init(str(tmp_path / "ckpt"), init_process_group=False)
    try:
        callback = FaultTolerance()
        args = TrainingArguments(
            str(tmp_path / "out"), use_cpu=True, enable_jit_checkpoint=True, report_to=[]
        )
        with pytest.raises(ValueError, match="enable_jit_checkpoint"):
            callback.on_init_end(args, None, None)
        callback.on_init_end(TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[]), None, None)
    finally:
        ft.shutdown()


@pytest.fixture
def joined(tmp_path, monkeypatch):
    """worker_lib joined as an adapter joins it (storage only), on this CPU machine: one rank, gloo."""
    import worker_lib as ft

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FTLAUNCH_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    ft.init(str(tmp_path / "ckpt"), init_process_group=False)
    yield ft.info()
    ft.shutdown()


def test_a_framework_that_counts_other_ranks_than_ftlaunch_is_stopped_with_the_fix(joined):
    """Accelerate or the Trainer left to their defaults on a CPU node: each rank alone, as rank 0."""
    with pytest.raises(RuntimeError, match=r"counts 2 rank\(s\) where ftlaunch started 1.*cpu=True"):
        check_placement("Accelerate", 2, "cpu", "pass cpu=True")


def test_a_framework_on_another_device_than_ftlaunch_chose_is_said_once(joined, caplog, monkeypatch):
    monkeypatch.setattr(_common, "_WARNED", set())
    assert joined.device == "cpu"
    with caplog.at_level("WARNING", logger=_common.__name__):
        check_placement("Lightning", 1, "cpu", "fix")  # where ftlaunch put it: nothing to say
        check_placement("Lightning", 1, "cuda:0", "the fix")
        check_placement("Lightning", 1, "cuda:0", "the fix")
    assert [r.getMessage() for r in caplog.records] == [
        "Lightning trains on cuda:0, but ftlaunch chose cpu for this rank (backend gloo): the fix"
    ]
