"""The node-local memory tier (issue 26): snapshots in /dev/shm, kept by the supervisor's side of
the node, that a crashed group reloads instead of going back to the last storage save."""

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, Launcher, dead_pid, memory_folders, tiny_tmpfs, wait_for_files
from test_checkpoint_e2e import _assert_bit_identical

from worker_lib.checkpoint.commit import CheckpointError
from worker_lib.checkpoint.manager import LocalChannel
from worker_lib.checkpoint.memory import MemorySnapshots

TRAIN = str(SCRIPTS / "ckpt_train.py")
SHM = Path("/dev/shm")


def _run(launcher, tmp_path, name, *script_args):
    out = tmp_path / f"{name}.pt"
    launch = launcher.run(
        "--nproc", "2", "--run-name", name, "--checkpoint-dir", str(tmp_path / "ckpt" / name),
        TRAIN, "--out", str(out), "--steps", "30", *script_args, timeout=180,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr
    assert launch.survivors() == []
    assert memory_folders(launch.proc.pid) == []  # the run is over: nothing of it in shared memory
    return launch, torch.load(out)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The run without a crash that each crashed run must end bit-identical to (once per module:
    its tests share an xdist group)."""
    tmp_path = tmp_path_factory.mktemp("clean")
    runner = Launcher(tmp_path)
    try:
        _, weights = _run(runner, tmp_path, "clean")
    finally:
        leaked = runner.cleanup()
    assert not leaked, leaked
    return weights


def _starts(launch, attempt: int) -> set:
    return {int(s) for s in re.findall(rf"rank \d attempt {attempt} starts at step (\d+)", launch.stdout)}


@pytest.mark.xdist_group("memory-clean")
def test_a_crash_reloads_the_newest_memory_step_and_ends_bit_identical(launcher, tmp_path, clean):
    # as a supervisor killed with its guard leaves it: the kernel dropped the lock on its .owner
    left = SHM / f"ftlaunch-memory-owned-{dead_pid()}-left"
    left.mkdir()
    (left / ".owner").touch()
    (left / "rank_0.0").write_bytes(b"x" * 1000)
    launch, crashed = _run(
        launcher, tmp_path, "crashed", "--memory-every", "1", "--crash", "17:0", "--crash-after-backward"
    )
    assert not left.exists()  # the launch removed it
    # Rank 1 died in step 17, past its all-reduce: rank 0 had taken its snapshot of step 17 too
    # (a crash at the step's start could kill rank 0 half-way through it: then 16 is right).
    # Storage holds step 15 at most.
    assert _starts(launch, 1) == {17}, launch.stdout
    assert "attempt 1: every rank loaded step 17 from memory" in launch.stderr
    assert "loaded step 17 from memory)" in launch.stderr  # the summary's recovery line
    _assert_bit_identical(clean, crashed)


@pytest.mark.xdist_group("memory-clean")
def test_a_crash_during_a_snapshot_falls_back_to_the_previous_one(launcher, tmp_path, clean):
    launch, crashed = _run(launcher, tmp_path, "torn", "--memory-every", "1", "--die-mid-snapshot", "17")
    assert "rank 1: dying half-way through its memory snapshot of step 17" in launch.stdout
    assert _starts(launch, 1) == {16}, launch.stdout
    assert "attempt 1: every rank loaded step 16 from memory" in launch.stderr
    _assert_bit_identical(clean, crashed)


@pytest.mark.xdist_group("memory-clean")
@pytest.mark.parametrize("moment, loaded", [("indexed", 16), ("recorded", 17)])
def test_a_crash_in_a_snapshots_background_part_loads_the_newest_step_every_rank_completed(
    launcher, tmp_path, clean, moment, loaded
):
    """Issue 51.5: save returns after the copy; the index, the record and the vote follow on the
    rank's thread. Rank 1 is SIGKILLed there, at ``moment`` of step 17, rank 0 holding step 17:
    before its record (index written), step 17 is half-made on rank 1 and 16 loads; after it
    (not yet shared), 17 is whole on both and loads. Either way bit-identical."""
    name = f"background-{moment}"
    launch, crashed = _run(
        launcher, tmp_path, name, "--memory-every", "1", "--die-in-snapshot", f"17:{moment}"
    )
    assert f"rank 1: dying at '{moment}' of its memory snapshot of step 17" in launch.stdout
    assert _starts(launch, 1) == {loaded}, launch.stdout
    assert f"attempt 1: every rank loaded step {loaded} from memory" in launch.stderr
    _assert_bit_identical(clean, crashed)


def test_a_killed_supervisor_is_resumed_from_storage_and_its_memory_is_freed(launcher, tmp_path):
    """Memory snapshots go with the supervisor: kill -9 of ftlaunch frees them (its orphan guard),
    and the relaunch resumes from the newest storage step, on every rank."""
    args = ("--nproc", "2", "--run-name", "killed", "--checkpoint-dir", str(tmp_path / "ckpt"), TRAIN)
    script = (
        "--out",
        str(tmp_path / "out.pt"),
        "--steps",
        "150",
        "--step-time",
        "0.02",
        "--memory-every",
        "1",
        "--until-attempt",
        "1",  # attempt 0 trains until this test kills its supervisor: it cannot finish first
    )
    first = launcher.start(*args, *script)
    wait_for_files(tmp_path / "ckpt", "step_*/COMMITTED", 2, timeout=90)
    (folder,) = memory_folders(first.proc.pid)
    wait_for_files(folder, "rank_*.json", 2, timeout=30)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.wait(10)
    assert first.survivors_after(10) == []
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:  # the guard removes it once it sees EOF
        time.sleep(0.05)
    assert not folder.exists()
    stored = max(int(p.parent.name[len("step_") :]) for p in (tmp_path / "ckpt").glob("step_*/COMMITTED"))
    again = launcher.run(*args, *script, timeout=180)
    assert again.proc.returncode == 0, again.stderr
    assert f"every rank loaded step {stored} from storage" in again.stderr, (stored, again.stderr)
    assert _starts(again, 1) == {stored}
    assert again.survivors() == [] and memory_folders(again.proc.pid) == []


@pytest.fixture
def tiny_shm(tmp_path):
    """A 256 KiB tmpfs: /dev/shm as a container's default 64 MiB is to a large model."""
    with tiny_tmpfs(tmp_path / "shm", "256k") as mount:
        yield mount


def test_a_snapshot_that_does_not_fit_is_a_clear_error_and_keeps_the_last_one(tiny_shm):
    snaps = MemorySnapshots(tiny_shm, 0, 1, LocalChannel())
    try:
        snaps.save(1, {"state": torch.zeros(20_000), "rng": None}, {})  # 80 KB
        asked = r"rank 0: no room for its memory snapshot in .* \(234 KiB asked, \d+ KiB free; each rank"
        with pytest.raises(CheckpointError, match=asked):
            snaps.save(2, {"state": torch.zeros(60_000), "rng": None}, {})  # 240 KB
        assert snaps.held() == {1: 0}  # the last whole snapshot is intact, the torn one removed
        assert sorted(p.name for p in tiny_shm.iterdir()) == ["rank_0.0", "rank_0.0.index", "rank_0.0.json"]
        payload, problem = snaps.read(1)
        assert problem is None and torch.equal(payload["state"], torch.zeros(20_000))
    finally:
        snaps.close()  # its mappings: the tmpfs cannot be unmounted under them


@pytest.mark.timeout(600)  # its own waits (two launches, a relaunch, 180 s for the job) exceed 120 s
def test_a_node_that_lost_its_memory_makes_every_rank_load_from_storage(launcher, tmp_path):
    """Issue 26.3: node 1's supervisor is killed, and its memory tier with it. Node 0 still holds
    its snapshots, but a step is loadable from memory only when every rank holds it: the
    relaunched job agrees on the newest storage step, on both nodes. No copies on other nodes
    (--memory-peers 0): with them node 1 gets its snapshot back from node 0's copy
    (tests/test_memory_copies.py)."""
    from test_many_nodes import Job

    job = Job(
        launcher, tmp_path, 2, "--nproc", "1", "--run-name", "lost", "--memory-peers", "0",
        "--checkpoint-dir", str(tmp_path / "ckpt"), TRAIN, "--out", str(tmp_path / "out.pt"),
        "--steps", "150", "--step-time", "0.02", "--memory-every", "1", "--replicated",
        "--until-attempt", "1",  # attempt 0 trains until node 1 is killed: it cannot finish first
    ).start_all()  # fmt: skip
    wait_for_files(tmp_path / "ckpt", "step_*/COMMITTED", 2, timeout=90)
    os.kill(job.nodes[1].proc.pid, signal.SIGKILL)
    job.nodes[1].wait(10)
    assert job.nodes[1].survivors_after(10) == []
    job.start(1)
    assert job.wait(180) == {0: 0, 1: 0}, job.nodes[0].stderr
    loaded = re.findall(r"attempt 1: every rank loaded step (\d+) from (\w+)", job.nodes[0].stderr)
    assert len(loaded) == 1 and loaded[0][1] == "storage" and int(loaded[0][0]) % 10 == 0, loaded
    step = int(loaded[0][0])
    assert f"rank 0 attempt 1 starts at step {step}" in job.nodes[0].stdout
    assert f"rank 1 attempt 1 starts at step {step}" in job.nodes[1].stdout
    assert job.survivors() == []
    assert memory_folders(job.nodes[0].proc.pid) == [] and memory_folders(job.nodes[1].proc.pid) == []
