"""The framework adapters on one GPU under ftlaunch (NCCL), through the examples with deterministic
algorithms on. A crash (SIGKILL at step 25) resumes from step 20, the newest committed step, and
the first step saved after it (30) holds the weights of an uninterrupted run's step 30, bit for
bit: the weights live on the GPU, and the dropout masks come from each rank's CUDA random state,
restored with the step. Then a SIGTERM makes the rank save one agreed step and ftlaunch exit 143;
the relaunch goes on from that step to the end, where the weights equal the uninterrupted run's
wherever the CPU runs are exact mid-epoch (the Trainer, Accelerate). Lightning starts a plain
loader's epoch again from its first batch, as its adapter's docs say; here, in a run that itself
resumed from an epoch's end, it also trains that epoch's 20 steps again in full."""

import re
import signal
import time
from pathlib import Path

import pytest
import torch
from adapter_runs import EXAMPLES, device_of_starts, final_step, starts

# Three launches of a framework each, two at a time: a minute on an idle GPU machine.
pytestmark = pytest.mark.timeout(300)

STEPS = 40
DEVICE, BACKEND = "cuda:0", "nccl"  # one rank: its GPU, and the backend ftlaunch chooses with GPUs
# (example, its arguments on one rank: 40 optimizer steps, a save every 10). Lightning's epochs
# are 20 steps long (1280 samples, 64 a batch), so the step the crash resumes from is an epoch's end.
JOBS = {
    "lightning": ("lightning_train.py", ["--epochs", "2", "--batch-size", "64", "--save-every", "10"]),
    "transformers": ("transformers_train.py", ["--max-steps", "40", "--save-steps", "10"]),
    "accelerate": ("accelerate_train.py", ["--epochs", "1", "--save-every", "10"]),
}
EXACT_MID_EPOCH = {"transformers", "accelerate"}


def _command(framework: str, name: str, ckpt: Path, *extra: str) -> list:
    script, args = JOBS[framework]
    return [
        *("--nproc", "1", "--run-name", name, "--checkpoint-dir", str(ckpt), *extra),
        *(str(EXAMPLES / script), *args, "--deterministic"),
    ]


@pytest.mark.parametrize("framework", sorted(JOBS))
def test_a_crash_and_a_preemption_on_a_gpu_resume_from_the_newest_committed_step(
    framework, launcher, tmp_path
):
    clean_ckpt, ckpt = tmp_path / "clean", tmp_path / "ckpt"
    clean = launcher.start(*_command(framework, "clean", clean_ckpt), "--out", str(tmp_path / "clean.pt"))
    # 0.1 s steps: the kill, sent within 50 ms of ftlaunch seeing step 25, lands before step 30's
    # save; the SIGTERM, sent once step 30 is committed, leaves 0.7 s before the last step.
    chaos = ("--chaos", "kill:rank=0,at=step:25")
    faulty = launcher.start(*_command(framework, "faulty", ckpt, *chaos), "--step-time", "0.1")
    for launch in (clean, faulty):  # from here on both consoles are read as they come (no full pipe)
        launch.read_console_until(lambda line: "attempt 0: starting" in line, timeout=240, stream="stderr")
        launch.read_console_until(lambda line: "attempt 0 " in line, timeout=240)
    faulty.read_console_until(lambda line: re.search(r"attempt 1 (starts|resumes)", line), timeout=240)
    _wait_for_file(ckpt / "step_30" / "COMMITTED", faulty)
    faulty.proc.send_signal(signal.SIGTERM)
    assert faulty.wait(120) == 143, faulty.stderr[-3000:]
    assert clean.wait(240) == 0, clean.stderr[-3000:]

    for launch in (clean, faulty):
        assert f"backend {BACKEND}" in launch.stderr, launch.stderr[-3000:]
        assert set(device_of_starts(launch.stdout)) == {DEVICE}, launch.stdout[-3000:]
        _assert_one_start_path(launch.stderr)
    assert starts(faulty.stdout) == [0, 20], faulty.stdout[-3000:]
    # Read before the relaunch: its retention keeps only its own last two steps.
    _assert_equal(_weights_at(ckpt, 30, framework), _weights_at(clean_ckpt, 30, framework))
    asked = re.search(r"asking the workers to save and stop at step (\d+)", faulty.stderr)
    assert asked, faulty.stderr[-3000:]
    stop = int(asked.group(1))
    assert 30 < stop < STEPS and (ckpt / f"step_{stop}" / "COMMITTED").exists()

    resumed = launcher.run(
        *_command(framework, "resumed", ckpt), "--out", str(tmp_path / "resumed.pt"), timeout=240
    )
    assert resumed.proc.returncode == 0, resumed.stderr[-3000:]
    assert starts(resumed.stdout) == [stop], resumed.stdout[-3000:]  # no step lost, none done twice
    assert final_step(clean.stdout) == STEPS, clean.stdout[-3000:]
    if framework in EXACT_MID_EPOCH:
        assert final_step(resumed.stdout) == STEPS, resumed.stdout[-3000:]
        _assert_equal(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "clean.pt"))
    else:  # Lightning 2.6.6 runs the whole epoch again (tests/test_integrations.py: not after a fresh start)
        assert final_step(resumed.stdout) == stop + STEPS // 2, resumed.stdout[-3000:]
    assert clean.survivors() == [] and faulty.survivors() == [] and resumed.survivors() == []


def _weights_at(ckpt: Path, step: int, framework: str) -> dict:
    """The model's tensors in a committed step, as the framework wrote them."""
    files = ckpt / f"step_{step}" / "files"
    if framework == "lightning":
        return torch.load(files / "lightning.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    from safetensors.torch import load_file

    return load_file(str(files / "model.safetensors"))


def _assert_equal(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys() and expected
    for name, value in expected.items():
        assert torch.equal(found[name].cpu(), value.cpu()), name


def _assert_one_start_path(stderr: str) -> None:
    """Workers are forked from the fork server, or, when it cannot serve, started as new
    processes: then ftlaunch says so once, with why."""
    off = re.findall(r"fork server off: .*", stderr)
    assert len(off) <= 1, off


def _wait_for_file(path: Path, launch, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert launch.proc.poll() is None, launch.stderr[-3000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout}s"
        time.sleep(0.05)
