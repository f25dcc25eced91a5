"""format="dcp" on one rank (no process group, no process started): torch.distributed.checkpoint
writes the step, ftlaunch commits it, and the load verifies, falls back on damage and loads in
place."""

import logging
import os
import time

import pytest
import torch

import worker_lib.dcp
from worker_lib import checksum
from worker_lib.checkpoint import CheckpointManager, LocalChannel
from worker_lib.dcp import check_ahead, load_dcp, save_dcp
from worker_lib.marker import committed_steps
from worker_lib.storage import Storage


def _manager(path) -> CheckpointManager:
    return CheckpointManager(Storage(str(path)), 0, 1, LocalChannel())


def _state(value: float) -> dict:
    return {"model": {"weight": torch.full((4, 3), value), "bias": torch.arange(3.0) + value}, "step": 7}


@pytest.mark.parametrize("blocking", [False, True])
def test_a_dcp_step_is_committed_with_every_file_listed_and_loads_in_place(tmp_path, blocking):
    manager = _manager(tmp_path)
    save_dcp(manager, 10, _state(1.0), {"loss": 0.5}, blocking)
    manager.wait()
    (marker,) = committed_steps(manager.storage)
    assert marker.kind == "dcp" and marker.metrics == {"loss": 0.5}
    on_disk = {f"dcp/{p.name}" for p in (tmp_path / "step_10" / "dcp").iterdir()} | {"rank_0.pt"}
    assert set(marker.parts) == on_disk and "dcp/.metadata" in on_disk

    into = _state(0.0)
    found = load_dcp(manager, into)
    assert found.step == 10 and found.state is into and found.metrics == {"loss": 0.5}
    assert torch.equal(into["model"]["weight"], torch.full((4, 3), 1.0))
    assert torch.equal(into["model"]["bias"], torch.arange(3.0) + 1.0)


def test_a_damaged_dcp_file_falls_back_to_the_previous_step(tmp_path, caplog):
    manager = _manager(tmp_path)
    for step, value in ((10, 1.0), (20, 2.0)):
        save_dcp(manager, step, _state(value), {}, blocking=False)
    manager.wait()
    shard = next(p for p in (tmp_path / "step_20" / "dcp").iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one byte flipped, the size kept

    into = _state(0.0)
    with caplog.at_level(logging.WARNING):
        found = load_dcp(manager, into)
    assert found.step == 10 and torch.equal(into["model"]["weight"], torch.full((4, 3), 1.0))
    assert "fails its checksum" in caplog.text


@pytest.fixture
def files_read(monkeypatch):
    """The paths of the files checksummed by reading them (a test clears it after its saves)."""
    monkeypatch.setattr(worker_lib.dcp, "_ahead", None)
    read = []
    whole = checksum.of_file

    def of_file(path, *args):
        read.append(path)
        return whole(path, *args)

    monkeypatch.setattr(checksum, "of_file", of_file)
    return read


def test_the_load_uses_the_check_started_at_init(tmp_path, files_read):
    manager = _manager(tmp_path)
    save_dcp(manager, 10, _state(1.0), {}, blocking=True)
    manager.wait()
    files_read.clear()
    check_ahead(manager)  # what ft.init() does
    worker_lib.dcp._ahead._thread.join()
    ahead = sorted(files_read)
    assert ahead == sorted(str(p) for p in (tmp_path / "step_10" / "dcp").iterdir())

    into = _state(0.0)
    assert load_dcp(manager, into).step == 10 and torch.equal(into["model"]["weight"], torch.full((4, 3), 1.0))
    assert sorted(files_read) == ahead  # nothing read again


def _after_the_clock_moved(path) -> None:
    """Until a write now would change ``path``'s times (they have a clock tick's resolution)."""
    probe = path.parent / "probe"
    for _ in range(10_000):
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
            probe.unlink()
            return
        time.sleep(0.001)
    raise AssertionError("the file system's clock did not move in 10 s")


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_a_file_damaged_after_the_early_check_is_checked_again(tmp_path, files_read, caplog, how):
    manager = _manager(tmp_path)
    for step, value in ((10, 1.0), (20, 2.0)):
        save_dcp(manager, step, _state(value), {}, blocking=True)
    manager.wait()
    files_read.clear()
    check_ahead(manager)
    worker_lib.dcp._ahead._thread.join()
    shard = next(p for p in (tmp_path / "step_20" / "dcp").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one byte flipped, the size kept
    if how == "in place":
        _after_the_clock_moved(shard)
        with open(shard, "r+b") as handle:
            handle.write(data)
    else:
        (shard.parent / "new").write_bytes(data)
        os.replace(shard.parent / "new", shard)

    into = _state(0.0)
    with caplog.at_level(logging.WARNING):
        found = load_dcp(manager, into)
    assert found.step == 10 and torch.equal(into["model"]["weight"], torch.full((4, 3), 1.0))
    assert "fails its checksum" in caplog.text and files_read.count(str(shard)) == 2


def test_no_early_check_when_the_newest_step_is_not_dcp(tmp_path, files_read):
    manager = _manager(tmp_path)
    save_dcp(manager, 10, _state(1.0), {}, blocking=True)
    manager.save(20, _state(3.0), blocking=True)
    files_read.clear()
    check_ahead(manager)
    assert worker_lib.dcp._ahead is None and files_read == []


def test_a_step_of_parts_is_not_loaded_into_a_state_and_a_fresh_run_finds_none(tmp_path):
    manager = _manager(tmp_path)
    assert load_dcp(manager, _state(0.0)) is None
    manager.save(5, _state(3.0), blocking=True)
    assert load_dcp(manager, _state(0.0)) is None  # step 5 is not DCP: nothing to load in place


def test_a_state_that_does_not_match_the_step_is_a_clear_error(tmp_path):
    manager = _manager(tmp_path)
    save_dcp(manager, 10, _state(1.0), {}, blocking=True)
    with pytest.raises(Exception, match="step 10 does not load into this state"):
        load_dcp(manager, {"model": {"other": torch.zeros(2)}})


def test_an_asynchronous_save_keeps_the_state_as_it_was_at_the_call(tmp_path):
    """The training loop changes the weights in place right after the call: the step holds the
    values of the call (DCP's staging copy), not a mix."""
    manager = _manager(tmp_path)
    state = {"w": torch.ones(1_000_000)}
    save_dcp(manager, 10, state, {}, blocking=False)
    state["w"].mul_(5)
    manager.wait()
    into = {"w": torch.zeros(1_000_000)}
    assert load_dcp(manager, into).step == 10 and torch.equal(into["w"], torch.ones(1_000_000))


@pytest.mark.parametrize("victim", [".metadata", ".distcp"])
def test_damage_that_breaks_the_load_itself_falls_back_too(tmp_path, caplog, victim):
    """Damage DCP itself would trip over (its metadata, a shard's header) is found by the
    checksum first: the previous step is loaded, not an error."""
    manager = _manager(tmp_path)
    for step, value in ((10, 1.0), (20, 2.0)):
        save_dcp(manager, step, _state(value), {}, blocking=True)
    shard = next(p for p in (tmp_path / "step_20" / "dcp").iterdir() if p.name.endswith(victim))
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)  # the first half zeroed, the size kept
    shard.write_bytes(bytes(data))

    into = _state(0.0)
    with caplog.at_level(logging.WARNING):
        found = load_dcp(manager, into)
    assert found.step == 10 and torch.equal(into["model"]["weight"], torch.full((4, 3), 1.0))
    assert "fails its checksum" in caplog.text
