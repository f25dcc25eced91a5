"""GPU staging under ftlaunch (issue 32): ``--nproc 1``, DDP over NCCL, all state on the GPU. A
crash resumes bit-identically from storage and from memory; a kill -9 of ftlaunch leaves no
process (so no pinned memory: it is a process's) and no shared memory behind."""

import os
import signal
import time

import pytest
import torch
from helpers import SCRIPTS, memory_folders, wait_for_files

TRAIN = str(SCRIPTS / "gpu_train.py")


def _run(launcher, tmp_path, name, *script_args):
    out = tmp_path / f"{name}.pt"
    launch = launcher.run(
        "--nproc", "1", "--run-name", name, "--checkpoint-dir", str(tmp_path / "ckpt" / name),
        TRAIN, "--out", str(out), *script_args, timeout=240,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr
    assert launch.survivors() == []
    assert memory_folders(launch.proc.pid) == []
    return launch, torch.load(out)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    from helpers import Launcher

    tmp_path = tmp_path_factory.mktemp("clean")
    runner = Launcher(tmp_path)
    try:
        _, weights = _run(runner, tmp_path, "clean")
    finally:
        leaked = runner.cleanup()
    assert not leaked, leaked
    return weights


@pytest.mark.parametrize(
    "tier, extra, step",
    [("storage", (), 10), ("memory", ("--memory-every", "1"), 12)],  # saved every 5 steps; crash in 12
)
def test_a_crash_resumes_bit_identically(launcher, tmp_path, clean, tier, extra, step):
    launch, crashed = _run(launcher, tmp_path, f"crashed-{tier}", "--crash", "12", *extra)
    assert "rank 0: crash at step 12" in launch.stdout
    assert f"every rank loaded step {step} from {tier}" in launch.stderr, launch.stderr
    assert "rank 0 restored its model onto ['cuda:0']" in launch.stdout
    assert clean.keys() == crashed.keys()
    for key in clean:
        assert torch.equal(clean[key], crashed[key]), key


def test_a_killed_ftlaunch_leaves_no_process_and_no_shared_memory(launcher, tmp_path):
    args = ("--nproc", "1", "--run-name", "killed", "--checkpoint-dir", str(tmp_path / "ckpt"), TRAIN)
    script = (
        "--out",
        str(tmp_path / "out.pt"),
        "--steps",
        "100000",
        "--step-time",
        "0.01",
        "--memory-every",
        "1",
    )
    first = launcher.start(*args, *script)
    folder = _until(lambda: memory_folders(first.proc.pid), 60)[0]
    wait_for_files(folder, "rank_0.*.json", 2, timeout=120)  # both slots written, so both registered
    os.kill(first.proc.pid, signal.SIGKILL)
    first.wait(30)
    assert first.survivors_after(15) == []  # the worker is gone: its pinned memory and GPU context too
    assert _until(lambda: not folder.exists(), 15)  # the orphan guard removes it once it sees EOF


def _until(found, timeout: float):
    """``found()`` once it is true, within ``timeout`` s; else an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s")
