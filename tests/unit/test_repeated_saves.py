"""A save of a step already in storage (saved or loaded by this process) is skipped: writing a
committed step's files again would leave it torn until its new marker lands, and a crash in
between would lose it. Found by trying it: a resumed loop that saves the step it loaded first,
or a periodic save and a stop-time save at one step, rewrote the committed step in place.

Each test kills the save the way a SIGKILL would, after its files and before its marker
(``Commits._write_marker`` raises), and checks what storage holds."""

import logging
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from worker_lib.checkpoint.commit import Commits
from worker_lib.checkpoint.dcp import load_dcp, save_dcp
from worker_lib.checkpoint.directory import latest_directory, node_cache_root, save_directory
from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
from worker_lib.checkpoint.memory import MemorySnapshots
from worker_lib.core.storage import Storage


def _manager(path, memory=None) -> CheckpointManager:
    return CheckpointManager(Storage(str(path)), 0, 1, LocalChannel(), memory=memory)


def _kill_before_markers(monkeypatch) -> None:
    def dies(self, step, *rest):
        raise RuntimeError(f"killed before the marker of step {step}")

    monkeypatch.setattr(Commits, "_write_marker", dies)


def _files(path: Path) -> dict:
    return {
        p.relative_to(path): (p.stat().st_mtime_ns, p.read_bytes()) for p in path.rglob("*") if p.is_file()
    }


def test_a_resumed_loop_that_saves_the_step_it_loaded_leaves_it_whole(tmp_path, monkeypatch, caplog):
    _manager(tmp_path).save(10, {"w": torch.full((4,), 1.0)}, blocking=True)
    before = _files(tmp_path)
    resumed = _manager(tmp_path)
    assert resumed.load().step == 10
    _kill_before_markers(monkeypatch)
    with caplog.at_level(logging.WARNING):
        resumed.save(10, {"w": torch.full((4,), 2.0)}, blocking=True)
    assert "checkpoint step 10 is already in storage" in caplog.text
    assert _files(tmp_path) == before
    found = _manager(tmp_path).load()
    assert found.step == 10 and torch.equal(found.state["w"], torch.full((4,), 1.0))


def test_two_saves_at_one_step_write_it_once_and_a_new_step_is_still_written(tmp_path, monkeypatch):
    manager = _manager(tmp_path)
    manager.save(10, {"w": torch.zeros(2)}, blocking=False)
    manager.wait()
    before = _files(tmp_path)
    _kill_before_markers(monkeypatch)
    manager.save(10, {"w": torch.ones(2)}, blocking=True)  # the stop-time save at the same step
    assert _files(tmp_path) == before
    with pytest.raises(RuntimeError, match="killed before the marker of step 11"):
        manager.save(11, {"w": torch.ones(2)}, blocking=True)
    assert torch.equal(_manager(tmp_path).load().state["w"], torch.zeros(2))


def test_a_dcp_step_loaded_is_not_written_again(tmp_path, monkeypatch):
    save_dcp(_manager(tmp_path), 10, {"w": torch.full((3, 3), 1.0)}, {}, blocking=True)
    before = _files(tmp_path)
    resumed = _manager(tmp_path)
    into = {"w": torch.zeros(3, 3)}
    assert load_dcp(resumed, into).step == 10
    _kill_before_markers(monkeypatch)
    save_dcp(resumed, 10, {"w": torch.full((3, 3), 2.0)}, {}, blocking=True)
    assert _files(tmp_path) == before
    again = {"w": torch.zeros(3, 3)}
    assert load_dcp(_manager(tmp_path), again).step == 10 and torch.equal(again["w"], torch.full((3, 3), 1.0))


def test_a_directory_step_loaded_is_not_written_again_and_the_script_still_gets_a_folder(
    tmp_path, monkeypatch
):
    storage = tmp_path / "storage"
    run_id = f"test-{uuid.uuid4().hex}"
    try:
        first = _manager(storage)
        with save_directory(first, 10, {}) as folder:
            Path(folder, "weights.bin").write_bytes(b"first")
        first.wait()
        resumed = _manager(storage)
        before = _files(storage)
        assert latest_directory(resumed, run_id, attempt=0).step == 10
        _kill_before_markers(monkeypatch)
        with save_directory(resumed, 10, {}) as folder:
            Path(folder, "weights.bin").write_bytes(b"second")
        resumed.wait()
        assert _files(storage) == before and not Path(folder).exists()
    finally:
        shutil.rmtree(node_cache_root(run_id), ignore_errors=True)


@pytest.mark.parametrize("memory_step, repeated", [(10, True), (12, False)])
def test_a_step_loaded_from_memory_is_skipped_only_when_storage_holds_it(
    tmp_path, monkeypatch, memory_step, repeated
):
    storage, shm = tmp_path / "storage", tmp_path / "shm"
    shm.mkdir()  # the supervisor makes it
    first = _manager(storage, MemorySnapshots(shm, 0, 1, LocalChannel(), timeout=5))
    first.save(10, {"w": torch.full((2,), 1.0)}, blocking=True)
    first.snapshot(memory_step, {"w": torch.full((2,), 1.0)})
    first.wait_all()  # as its exit does: the snapshot's record follows the call, on its thread
    resumed = _manager(storage, MemorySnapshots(shm, 0, 1, LocalChannel(), timeout=5))
    assert resumed.load().step == memory_step
    _kill_before_markers(monkeypatch)
    if repeated:  # storage holds it: not written again
        resumed.save(memory_step, {"w": torch.full((2,), 2.0)}, blocking=True)
    else:  # only memory holds it: storage must get it
        with pytest.raises(RuntimeError, match=f"killed before the marker of step {memory_step}"):
            resumed.save(memory_step, {"w": torch.full((2,), 2.0)}, blocking=True)
    assert _manager(storage).load().step == 10
