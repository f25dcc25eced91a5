"""GPU staging in one process (issue 32): a save or a snapshot of CUDA state is the state at the
call, although the copy is only enqueued and the loop changes the state at once; what comes back
is on the GPU; pinned memory is reused; a refused registration falls back with one warning."""

import logging
import tempfile
from pathlib import Path

import pytest
import torch

from worker_lib.checkpoint.dcp import load_dcp, save_dcp
from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
from worker_lib.checkpoint.memory import MemorySnapshots
from worker_lib.checkpoint.staging import HostBuffer
from worker_lib.core.contract import LOADED_MEMORY
from worker_lib.core.storage import Storage

MB = 2**20


def _state(mb: int = 256):
    """A model and AdamW state on the GPU, large enough that its copy takes milliseconds."""
    torch.manual_seed(0)
    width = int((mb * MB / 4 / 3) ** 0.5)
    model = torch.nn.Linear(width, width, bias=False).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, width, device="cuda")).sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model, optimizer):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _clone(state):
    return {k: v.clone() for k, v in state["model"].items()}


def _mutate(model) -> None:
    """What the loop does right after the call: the next updates, queued on the same stream."""
    with torch.no_grad():
        for _ in range(20):
            for p in model.parameters():
                p.mul_(1.01).add_(1.0)


def _assert_equal_on_gpu(loaded, expected):
    for key, value in expected.items():
        assert loaded[key].is_cuda, key
        assert torch.equal(loaded[key], value), key


@pytest.fixture
def shm():
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ftlaunch-test-") as folder:
        yield Path(folder)


def test_a_storage_save_is_the_state_at_the_call(tmp_path):
    model, optimizer = _state()
    manager = CheckpointManager(Storage(str(tmp_path)), 0, 1, LocalChannel())
    for step in (1, 2):  # the second save reuses the pinned buffer of the first
        expected = _clone(_snapshot(model, optimizer))
        manager.save(step, _snapshot(model, optimizer))
        _mutate(model)
        manager.wait()
        loaded = manager.load()
        assert loaded.step == step
        _assert_equal_on_gpu(loaded.state["model"], expected)
    assert manager.pinned.buffer.pinned
    plain = torch.load(tmp_path / "step_2" / "rank_0.pt", weights_only=True)  # as torch.save of CUDA state
    assert all(t.is_cuda for t in plain["state"]["model"].values())


def test_a_memory_snapshot_is_the_state_at_the_call(tmp_path, shm):
    model, optimizer = _state()
    memory = MemorySnapshots(shm, 0, 1, LocalChannel())
    manager = CheckpointManager(Storage(str(tmp_path)), 0, 1, LocalChannel(), memory=memory)
    for step in (1, 2, 3):  # both slots, then the first again: its mapping is reused
        expected = _clone(_snapshot(model, optimizer))
        manager.snapshot(step, _snapshot(model, optimizer))
        _mutate(model)
    memory.flush()
    assert all(slot._buffer.pinned for slot in memory._slots)
    again = CheckpointManager(
        Storage(str(tmp_path)), 0, 1, LocalChannel(), memory=MemorySnapshots(shm, 0, 1, LocalChannel())
    )
    loaded = again.load()  # a fresh process's view: its mappings are not registered
    assert loaded.step == 3 and again.loaded_tier == LOADED_MEMORY
    _assert_equal_on_gpu(loaded.state["model"], expected)
    step_of = loaded.state["optimizer"]["state"][0]["step"]
    assert not step_of.is_cuda  # AdamW keeps its step count on the CPU: it comes back there


def test_a_dcp_save_is_the_state_at_the_call(tmp_path):
    model, optimizer = _state(64)
    manager = CheckpointManager(Storage(str(tmp_path)), 0, 1, LocalChannel())
    expected = _clone(_snapshot(model, optimizer))
    save_dcp(manager, 1, {"model": model.state_dict()}, {}, blocking=False)
    _mutate(model)
    manager.wait()
    target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    assert load_dcp(manager, target).step == 1
    _assert_equal_on_gpu(target["model"], expected)


def test_a_refused_registration_warns_once_and_pageable_copies_are_the_state_at_the_call(monkeypatch, caplog):
    """Host memory CUDA will not register (here: registered already, by someone else) stays
    pageable, with one warning per process; copies into pageable memory are synchronous, and
    the same snapshot."""
    import worker_lib.checkpoint.staging as staging
    from worker_lib.checkpoint.flat import rebuild, split

    monkeypatch.setattr(staging, "_warned_unpinned", False)
    model, optimizer = _state(64)
    parts = split(_snapshot(model, optimizer), copy_objects=True)
    buffer = HostBuffer(parts.layout.size)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(buffer.address, buffer.size, 0)) == 0
    try:
        with caplog.at_level(logging.WARNING, logger="worker_lib.checkpoint.staging"):
            assert not buffer.pin() and not buffer.pin()
    finally:
        cudart.cudaHostUnregister(buffer.address)
    assert len([r for r in caplog.records if "could not register" in r.getMessage()]) == 1, caplog.text

    expected = _clone(_snapshot(model, optimizer))
    views = buffer.views(parts.layout)
    events = staging.copy_in(parts.tensors, views)
    _mutate(model)
    for event in events:
        event.synchronize()
    copied = rebuild(parts.skeleton, views)["model"]
    for key, value in expected.items():
        assert torch.equal(copied[key], value.cpu()), key
    buffer.close()
