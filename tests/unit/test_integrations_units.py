"""The adapters' pure parts: which rank uploads which of a framework's files, the metrics kept,
and the Lightning callback's base class for either package name."""

import importlib
import math
import re
import sys

import pytest
import torch

from worker_lib.integrations._common import finite_metrics, is_own, keep_own_files

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
