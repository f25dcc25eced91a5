"""Warm spares on a GPU: the spare's CUDA context is made on its rank's GPU before the script runs,
a crash resumes through the spare bit-identically to a run that never stopped, and the spare's
GPU memory is measured and said once. One rank per GPU, at most two (the CI machine has one)."""

import json
import re

import torch
from helpers import SCRIPTS

TRAIN = str(SCRIPTS / "cuda_train.py")
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # read by cuBLAS as the spare makes its handle


def _seen(out, nproc, attempt):
    return [json.loads((out / f"rank_{r}.attempt_{attempt}.json").read_text()) for r in range(nproc)]


def test_a_crash_resumes_bit_identically_through_a_warm_spare_whose_context_is_on_its_gpu(launcher, tmp_path):
    nproc = min(2, torch.cuda.device_count())
    spared, plain = tmp_path / "spared", tmp_path / "plain"
    for out in (spared, plain):
        out.mkdir()
    a = launcher.run(
        "--nproc", str(nproc), "--warm-spare", "on", "--max-failures", "1", "--run-name", "spared",
        TRAIN, "--out", str(spared), "--crash", "7", "--wait-for-spare", env=DETERMINISTIC, timeout=55,
    )  # fmt: skip
    b = launcher.run(
        "--nproc", str(nproc), "--warm-spare", "off", "--run-name", "plain", TRAIN, "--out", str(plain),
        env=DETERMINISTIC, timeout=55,
    )  # fmt: skip
    assert a.proc.returncode == 0 and b.proc.returncode == 0, a.stderr + b.stderr
    assert "fork server off" not in a.stderr + b.stderr  # the zygote never initialized CUDA
    assert "attempt 1: starting" in a.stderr  # the crash was a restart, through the spares
    x, y = torch.load(spared / "weights.pt"), torch.load(plain / "weights.pt")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    for attempt in (0, 1):  # every worker started in a spare: its context made, on its own GPU only
        for rank, seen in enumerate(_seen(spared, nproc, attempt)):
            assert seen["initialized"] and seen["device"] == rank, seen
            assert [i for i, made in enumerate(seen["contexts"]) if made] == [rank], seen
    assert not any(seen["initialized"] for seen in _seen(plain, nproc, 0))  # without: the script makes it
    cost = re.search(r"warm spare: .*GPU memory each: (\d+)(?:–(\d+))? MiB", a.stderr)
    assert cost, a.stderr  # NVML counted it
    print(cost.group(0))
    assert 16 <= int(cost.group(1)) <= 4096  # a context and a cuBLAS workspace: tens to hundreds of MiB
    assert a.stderr.count("warm spare:") == 1 and "warm spare" not in b.stderr
    assert all(launch.survivors() == [] for launch in launcher.launches)


def test_a_restart_through_a_spare_reads_the_memory_tier_through_slots_it_registered_ahead(
    launcher, tmp_path
):
    spared, plain = tmp_path / "spared", tmp_path / "plain"
    for out in (spared, plain):
        out.mkdir()
    a = launcher.run(
        "--nproc", "1", "--warm-spare", "on", "--max-failures", "1", "--run-name", "spared",
        TRAIN, "--out", str(spared), "--crash", "7", "--memory", env=DETERMINISTIC, timeout=90,
    )  # fmt: skip
    b = launcher.run(
        "--nproc", "1", "--warm-spare", "off", "--run-name", "plain", TRAIN, "--out", str(plain),
        env=DETERMINISTIC, timeout=55,
    )  # fmt: skip
    assert a.proc.returncode == 0 and b.proc.returncode == 0, a.stderr + b.stderr
    # the rank waited for its spare to map both slots before it died: the restart read them
    loaded = "step 7 loaded from the node's memory tier (its slot mapped ahead by this worker's warm spare)"
    assert loaded in a.stdout + a.stderr, a.stdout + a.stderr
    assert "NCCL's set-up made ahead" in a.stderr, a.stderr
    assert _seen(spared, 1, 1)[0]["initialized"]  # attempt 1 ran in a spare
    x, y = torch.load(spared / "weights.pt"), torch.load(plain / "weights.pt")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert all(launch.survivors() == [] for launch in launcher.launches)
