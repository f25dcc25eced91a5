"""examples/fsdp_train.py on one GPU follows the GPU recipe by default: its shards snapshotted into
ftlaunch's memory tier after every step, storage every 10 steps. A rank killed at step 15 comes
back from its newest snapshot, not from storage's step 10, and the end equals a run without a
crash. (On CPUs the example takes no snapshot unless asked: tests/test_dcp.py.)"""

import re

import torch
from helpers import ROOT

FSDP = str(ROOT / "examples" / "fsdp_train.py")  # 20 steps, a save every 10


def test_a_crash_on_a_gpu_resumes_from_the_snapshot_of_its_last_step(launcher, tmp_path):
    def command(name: str) -> list:
        ckpt, out = str(tmp_path / name), str(tmp_path / f"{name}.pt")
        return ["--nproc", "1", "--run-name", name, "--checkpoint-dir", ckpt, FSDP, "--out", out]

    clean = launcher.start(*command("clean"))
    # 0.05 s steps: the kill, sent within 50 ms of ftlaunch seeing step 15, lands before step 20
    crashed = launcher.run(
        "--chaos", "kill:at=step:15", *command("crashed"), "--step-time", "0.05", timeout=180
    )
    assert crashed.proc.returncode == 0, crashed.stderr[-3000:]
    assert clean.wait(180) == 0, clean.stderr[-3000:]
    assert "backend nccl" in crashed.stderr
    loaded = re.findall(r"attempt 1: every rank loaded step (\d+) from (\w+)", crashed.stderr)
    assert len(loaded) == 1 and loaded[0][1] == "memory" and int(loaded[0][0]) >= 14, crashed.stderr[-3000:]
    assert f"rank 0 of 1 attempt 1 starts at step {loaded[0][0]}" in crashed.stdout, crashed.stdout[-3000:]
    expected, found = torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "crashed.pt")
    assert found.keys() == expected.keys() and expected
    for name, value in expected.items():
        assert torch.equal(found[name], value), name
    assert clean.survivors() == [] and crashed.survivors() == []
