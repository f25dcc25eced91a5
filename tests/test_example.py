"""The example trains for real with DDP on gloo, is killed once, and resumes from its checkpoint."""

import re

from helpers import ROOT


def test_example_recovers_from_a_crash_and_learns(launcher, tmp_path):
    launch = launcher.run(
        "--nproc",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
        str(ROOT / "examples" / "train.py"),
        "--epochs",
        "8",
        "--crash-at-step",
        "120",
        timeout=180,
    )

    assert launch.proc.returncode == 0, launch.stderr
    assert "[1] rank 1: injected crash at step 120 (SIGKILL)" in launch.stdout
    assert "attempt 0 failed: rank 1" in launch.stderr and "Signal 9 (SIGKILL)" in launch.stderr
    assert "[0] resumed from checkpoint at step 100" in launch.stdout
    final = re.search(r"final: step (\d+), test loss [\d.]+, test accuracy ([\d.]+)", launch.stdout)
    assert final and int(final.group(1)) == 8 * 22  # 1437 samples / 2 ranks / 32 per batch
    assert float(final.group(2)) > 0.9
    committed = sorted(p.parent.name for p in (tmp_path / "checkpoints").glob("step_*/COMMITTED"))
    assert committed == ["step_150", "step_176"]  # the last two (retention), the final one committed
    assert launch.survivors() == []
