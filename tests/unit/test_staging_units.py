"""The flat format (worker_lib.checkpoint.flat) and the host buffers it is copied into
(worker_lib.checkpoint.staging), on CPU tensors: the format and its damage cases are the same for
CUDA state; only registration with CUDA and the non-blocking copies need a GPU (tests/gpu)."""

import collections
import io
import json

import pytest
import torch

from worker_lib.checkpoint.commit import CheckpointError
from worker_lib.checkpoint.flat import ALIGN, Hole, decode_index, encode_index, on_cuda, rebuild, split
from worker_lib.checkpoint.manager import LocalChannel
from worker_lib.checkpoint.memory import MemorySnapshots
from worker_lib.checkpoint.staging import StagingArea, restore_location


def _state():
    torch.manual_seed(0)
    model = collections.OrderedDict(
        weight=torch.randn(3, 5),
        half=torch.randn(7, dtype=torch.bfloat16),
        mask=torch.tensor([True, False, True]),
        empty=torch.zeros(0, 4),
        strided=torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        scalar=torch.tensor(3, dtype=torch.int64),
    )
    return {
        "model": model,
        "step": 12,
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        "pair": (torch.ones(2), "x"),
    }


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_a_state_splits_into_tensors_and_a_skeleton_and_comes_back_whole():
    state = _state()
    parts = split(state, copy_objects=True)
    assert parts.names == [
        "model/weight", "model/half", "model/mask", "model/empty", "model/strided", "model/scalar", "pair/0",
    ]  # fmt: skip
    assert parts.skeleton["model"]["weight"] == Hole(0) and parts.skeleton["step"] == 12
    layout = parts.layout
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    assert layout.size >= sum(e.nbytes for e in layout.entries)
    assert not parts.on_cuda and not on_cuda(state)
    _assert_same(rebuild(parts.skeleton, parts.tensors), state)
    state["groups"][0]["lr"] = 0.2  # the loop changes an object after the call:
    assert parts.skeleton["groups"][0]["lr"] == 0.1  # the copied skeleton does not


def test_an_index_round_trips_and_a_damaged_one_is_a_value_error():
    parts = split(_state(), copy_objects=False)
    data = encode_index(parts.layout, parts.skeleton)
    layout, skeleton = decode_index(data)
    assert layout == parts.layout and skeleton["pair"] == (Hole(6), "x")
    for damaged in (
        data[: len(data) // 2],
        b"\x00" * 40,
        encode_index(parts.layout, None).replace(b"version", b"vershun"),
    ):
        with pytest.raises(ValueError, match="damaged"):
            decode_index(damaged)


def test_the_staging_area_copies_into_one_buffer_reused_and_grown_only_when_needed():
    area = StagingArea(rank=0)
    state = _state()
    first = area.stage(state)
    buffer = area.buffer
    assert first.events == []  # CPU tensors: copied at the call
    _assert_same(first.state, state)
    state["model"]["weight"].add_(1)  # the loop goes on: the staged copy is the state at the call
    assert not torch.equal(first.state["model"]["weight"], state["model"]["weight"])
    again = area.stage(state)
    assert area.buffer is buffer  # the same pages, no new allocation
    _assert_same(again.state, state)
    bigger = dict(state, more=torch.zeros(10_000))
    area.stage(bigger)
    assert area.buffer is not buffer and area.buffer.size >= 40_000
    area.close()


def test_a_state_larger_than_free_host_memory_is_a_clear_error():
    """A 4 TB tensor (a view of one number: nothing is allocated) asks more than any host has."""
    huge = {"w": torch.zeros(1).expand(10**12)}
    with pytest.raises(
        CheckpointError, match=r"rank 3: staging this checkpoint asks for 3\.6 TiB|rank 3: .* GiB"
    ):
        StagingArea(rank=3).stage(huge)


def test_a_part_written_from_staged_cuda_tensors_says_cuda_and_loads_on_the_cpu_here():
    """torch.save of a staging buffer's copy of a CUDA tensor records "cuda:N", as torch.save of
    the CUDA tensor would (so a load puts it back on a GPU); here, without one, it stays on the CPU."""
    area = StagingArea(rank=0)
    state = {"w": torch.randn(4), "step": torch.tensor(2.0)}
    staged = area.stage(state)
    area._tag(list(split(staged.state, copy_objects=False).tensors), ["cuda:0", None])  # as for a CUDA "w"
    handle = io.BytesIO()
    torch.save(staged.state, handle)
    seen = []
    handle.seek(0)
    torch.load(
        handle, map_location=lambda storage, location: seen.append(location) or storage, weights_only=True
    )
    assert sorted(seen) == ["cpu", "cuda:0"]
    handle.seek(0)
    loaded = torch.load(handle, map_location=restore_location(copy_cpu=False), weights_only=True)
    assert not loaded["w"].is_cuda and torch.equal(loaded["w"], state["w"])
    area.close()
    other = io.BytesIO()
    torch.save(staged.state, other)  # untagged once the area is closed: plain CPU storages again
    other.seek(0)
    seen.clear()
    torch.load(
        other, map_location=lambda storage, location: seen.append(location) or storage, weights_only=True
    )
    assert seen == ["cpu", "cpu"]


def test_a_mapped_part_is_copied_out_of_its_file(tmp_path):
    path = tmp_path / "part.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    loaded = torch.load(path, map_location=restore_location(copy_cpu=True), weights_only=True, mmap=True)
    path.write_bytes(b"\x00" * path.stat().st_size)  # what a deletion or a rewrite would do to a mapping
    assert torch.equal(loaded["w"], torch.arange(1000.0))


def test_every_kind_of_tensor_survives_the_memory_tier(tmp_path):
    snaps = MemorySnapshots(tmp_path, 0, 1, LocalChannel())
    state = _state()
    snaps.save(1, {"state": state, "rng": None}, {})
    state["model"]["weight"].zero_()  # after the call: not in the snapshot
    payload, problem = snaps.read(1)
    assert problem is None
    expected = _state()
    expected["model"]["weight"] = payload["state"]["model"]["weight"]
    _assert_same(payload["state"], expected)
    assert not torch.equal(payload["state"]["model"]["weight"], state["model"]["weight"])
    snaps.close()


def test_a_slot_keeps_its_mapping_for_a_state_of_the_same_size_and_remaps_for_another(tmp_path):
    snaps = MemorySnapshots(tmp_path, 0, 1, LocalChannel())
    for step in (1, 2):
        snaps.save(step, {"w": torch.full((1000,), float(step))}, {})
    mapped = snaps._slots[0]._buffer
    snaps.save(3, {"w": torch.full((1000,), 3.0)}, {})  # slot 0 again, the same layout
    assert snaps._slots[0]._buffer is mapped
    snaps.save(4, {"w": torch.full((100_000,), 4.0)}, {})  # slot 1, a bigger state
    assert (tmp_path / "rank_0.1").stat().st_size >= 400_000
    assert sorted(snaps.held()) == [3, 4]
    payload, _ = snaps.read(4)
    assert torch.equal(payload["w"], torch.full((100_000,), 4.0))
    snaps.close()


@pytest.mark.parametrize("damage", ["index", "record", "data"])
def test_a_damaged_slot_is_not_read(tmp_path, damage):
    """A torn index or data file fails the size check (not held); an index of the right size
    whose bytes are damaged is held, but its read reports the problem (then every rank goes to
    storage, through the vote)."""
    snaps = MemorySnapshots(tmp_path, 0, 1, LocalChannel())
    snaps.save(1, {"w": torch.ones(10)}, {})
    snaps.close()
    index, record, data = (tmp_path / f"rank_0.0{s}" for s in (".index", ".json", ""))
    if damage == "index":
        index.write_bytes(b"\x00" * index.stat().st_size)
    elif damage == "record":
        record.write_text(json.dumps(dict(json.loads(record.read_text()), index_size=1)))
    else:
        data.write_bytes(data.read_bytes()[:-1])
    again = MemorySnapshots(tmp_path, 0, 1, LocalChannel())
    if damage == "index":
        assert again.held() == {1: 0}
        payload, problem = again.read(1)
        assert payload is None and "memory snapshot of step 1" in problem and "damaged" in problem
    else:
        assert again.held() == {}
    again.close()


def test_a_failed_finish_is_raised_at_the_next_wait_and_the_next_job_runs():
    """The thread that ends a CUDA snapshot (waits on its events, writes its record): a failure
    there reaches the loop at its next call, as a CheckpointError, once."""
    from worker_lib.checkpoint.memory_slots import Finisher

    finisher = Finisher("test-finisher")
    done = []

    def fail():
        raise OSError("no room for the record")

    finisher.submit(fail)
    with pytest.raises(CheckpointError, match="the last memory snapshot failed: no room for the record"):
        finisher.wait()
    finisher.submit(lambda: done.append(1))
    finisher.wait()
    assert done == [1]
