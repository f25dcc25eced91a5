"""format="dcp" on one rank (no process group, no process started): torch.distributed.checkpoint
writes the step, ftlaunch commits it, and the load verifies, falls back on damage and loads in
place."""

import logging

import pytest
import torch

from worker_lib.checkpoint.dcp import load_dcp, save_dcp
from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
from worker_lib.checkpoint.marker import committed_steps
from worker_lib.core.storage import Storage


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
