"""Checkpoints end to end under ftlaunch: DDP on gloo, real crashes, real storage servers."""

import re

import torch
from helpers import ACTOR, SCRIPTS

TRAIN = str(SCRIPTS / "ckpt_train.py")


def _train(launcher, storage, tmp_path, name, *script_args):
    out = tmp_path / f"{name}.pt"
    launch = launcher.run(
        "--nproc",
        "2",
        "--run-name",
        name,
        "--checkpoint-dir",
        f"{storage.url}/{name}",
        TRAIN,
        "--out",
        str(out),
        *script_args,
        env=storage.env,
        timeout=180,
    )
    assert launch.proc.returncode == 0, launch.stderr
    assert launch.survivors() == []
    return launch, torch.load(out)


def _assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_two_crashes_end_bit_identical_to_no_crash(launcher, storage, tmp_path):
    _, clean = _train(launcher, storage, tmp_path, "clean")
    launch, crashed = _train(launcher, storage, tmp_path, "crashed", "--crash", "7:0", "--crash", "13:1")

    # Saves are asynchronous: how far the commits got before each crash depends on the storage's
    # speed, but every rank resumes from the same committed step, at or before the crash.
    starts = {
        (a, r): int(s)
        for r, a, s in re.findall(r"rank (\d) attempt (\d) starts at step (\d+)", launch.stdout)
    }
    assert set(starts) == {(str(a), str(r)) for a in range(3) for r in range(2)}
    assert starts[("1", "0")] == starts[("1", "1")] in (0, 5) and starts[("2", "0")] == starts[
        ("2", "1")
    ] in (5, 10)
    _assert_bit_identical(clean, crashed)


def test_replicated_state_is_written_once_and_resumes_exactly(launcher, tmp_path):
    from conftest import StorageTarget

    storage = StorageTarget("local", str(tmp_path / "ckpt"), {})
    _, clean = _train(launcher, storage, tmp_path, "clean", "--replicated")
    _, crashed = _train(launcher, storage, tmp_path, "crashed", "--replicated", "--crash", "12:0")
    _assert_bit_identical(clean, crashed)
    parts = sorted(p.name for p in (tmp_path / "ckpt" / "crashed" / "step_20").iterdir())
    assert parts == ["COMMITTED", "rank_0.pt", "rank_1.pt", "replicated.pt"]
    # Ranks' own parts hold only their RNG states: the model went up once, in replicated.pt.
    folder = tmp_path / "ckpt" / "crashed" / "step_20"
    for rank in (0, 1):
        part = torch.load(folder / f"rank_{rank}.pt", weights_only=False)
        assert part["state"] is None and part["rng"] is not None
    assert "model" in torch.load(folder / "replicated.pt", weights_only=False)


def test_a_rank_killed_before_the_commit_resumes_from_the_previous_step(launcher, tmp_path):
    from conftest import StorageTarget

    storage = StorageTarget("local", str(tmp_path / "ckpt"), {})
    _, clean = _train(launcher, storage, tmp_path, "clean")
    launch, crashed = _train(launcher, storage, tmp_path, "crashed", "--die-before-commit", "10")

    assert "rank 0: dying before the commit of step 10" in launch.stdout
    assert "[0] rank 0 attempt 1 starts at step 5" in launch.stdout
    _assert_bit_identical(clean, crashed)


def test_a_rank_killed_mid_write_resumes_from_the_previous_step(launcher, storage, tmp_path):
    _, clean = _train(launcher, storage, tmp_path, "clean")
    launch, crashed = _train(launcher, storage, tmp_path, "crashed", "--die-mid-write", "15")

    assert "rank 1: dying half-way through step_15/rank_1.pt" in launch.stdout
    # Never from the torn step 15. Commits are asynchronous and rank 0's: on a loaded machine the
    # commit of step 10 may not have happened yet when rank 1 died (seen with S3 under make test's
    # parallel load), and then both ranks agree on step 5.
    starts = set(re.findall(r"rank \d attempt 1 starts at step (\d+)", launch.stdout))
    assert starts in ({"10"}, {"5"}), launch.stdout
    _assert_bit_identical(clean, crashed)


def test_parts_that_never_committed_are_removed_when_the_run_ends(launcher, tmp_path):
    """A full disk or a rank that failed mid-save leaves parts without their marker: they can never
    be loaded, and they fill the storage. The run's end removes them; committed steps stay."""
    import torch

    from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
    from worker_lib.core.storage import Storage

    ckpt = tmp_path / "ckpt"
    CheckpointManager(Storage(str(ckpt)), 0, 1, LocalChannel()).save(5, {"w": torch.ones(3)}, blocking=True)
    for step in (6, 7):  # parts of two saves that never got their marker
        (ckpt / f"step_{step}").mkdir()
        (ckpt / f"step_{step}" / "rank_1.pt").write_bytes(b"x" * 1000)

    launch = launcher.run(
        "--checkpoint-dir", str(ckpt), "--max-failures", "0", str(ACTOR), "--fail", "exit", "--fail-rank", "0"
    )

    assert launch.proc.returncode == 1, launch.stderr
    assert "removed the parts of step(s) 6, 7, which were never committed" in launch.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_5"]
    assert (ckpt / "step_5" / "COMMITTED").exists()
    assert launch.survivors() == []


def test_a_run_that_succeeded_says_when_its_last_save_was_never_committed(launcher, tmp_path):
    """Every rank exited 0, but the newest save never got its marker (a final save that failed):
    the run succeeded, and its record says that its last work has no checkpoint."""
    import torch

    from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
    from worker_lib.core.storage import Storage

    ckpt = tmp_path / "ckpt"
    CheckpointManager(Storage(str(ckpt)), 0, 1, LocalChannel()).save(5, {"w": torch.ones(3)}, blocking=True)
    (ckpt / "step_7").mkdir()
    (ckpt / "step_7" / "rank_0.pt").write_bytes(b"x" * 1000)

    launch = launcher.run("--checkpoint-dir", str(ckpt), str(ACTOR))

    assert launch.proc.returncode == 0, launch.stderr
    said = "but the save of step 7 was never committed; the newest checkpoint is step 5"
    assert said in launch.stderr
    state = launch.run_state()
    assert state.status.value == "SUCCEEDED" and said in state.reason
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_5"]
    assert launch.survivors() == []


# A save still being written when the script ends: the pickle of its state holds the save's thread
# until the main thread has begun the interpreter's exit, then the tensor's bytes (8 MB, over the
# size whose checksum goes to the helper thread) are written.
_SAVE_AND_LEAVE = """
import threading, torch, worker_lib as ft

class UntilExit:
    def __reduce__(self):
        if threading.current_thread() is not threading.main_thread():
            threading.main_thread().join()  # returns once the exit has begun
        return (UntilExit, ())

ft.init()
ft.save_checkpoint(1, {"w": torch.ones(2_000_000), "gate": UntilExit()})
print("step 1 handed to the save thread; the script ends", flush=True)
"""


def test_a_save_still_being_written_as_the_script_ends_is_committed(launcher, tmp_path):
    """Once the interpreter's exit has begun, concurrent.futures takes no new work: the save's
    checksum, given to a helper thread, failed the whole save (found from outside) and the run
    ended 0 without its last step. The checksum is now taken on the save's own thread then."""
    script, ckpt = tmp_path / "save_and_leave.py", tmp_path / "ckpt"
    script.write_text(_SAVE_AND_LEAVE)
    for mode in ("--fork-server", "--no-fork-server"):
        name = mode[2:]
        launch = launcher.run(
            "--nproc", "1", "--run-name", name, "--checkpoint-dir", str(ckpt / name), mode, str(script)
        )  # fmt: skip
        assert launch.proc.returncode == 0, launch.stderr
        assert "save failed" not in launch.stdout + launch.stderr, launch.stdout + launch.stderr
        assert (ckpt / name / "step_1" / "COMMITTED").exists()
    assert all(launch.survivors() == [] for launch in launcher.launches)
