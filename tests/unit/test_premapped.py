"""Memory-tier slots mapped ahead by a warm spare (worker_lib.checkpoint.premapped): handed over
only for the same file at the same size, let go when the file changes or goes. On CPU nothing is
registered with CUDA (``pin=False``); the registration is tests/gpu's."""

import os

import pytest

from worker_lib.checkpoint import premapped
from worker_lib.checkpoint.memory_slots import SlotFiles


@pytest.fixture(autouse=True)
def _nothing_held_after():
    yield
    premapped.forget()


def _slot(folder, rank, slot, data: bytes):
    (folder / f"rank_{rank}.{slot}").write_bytes(data)


def test_a_slot_mapped_ahead_is_the_one_its_worker_reads(tmp_path):
    _slot(tmp_path, 3, 0, b"a" * 8192)
    _slot(tmp_path, 2, 0, b"b" * 8192)  # another rank's: not ours to map
    premapped.look(tmp_path, 3, pin=False)
    assert premapped.held() == {str(tmp_path / "rank_3.0"): False}
    buffer = premapped.take(tmp_path / "rank_3.0", 8192)
    assert buffer is not None and bytes(buffer._mapping()[:8]) == b"a" * 8
    assert premapped.held() == {}  # the caller's now
    buffer.close()


def test_a_slot_read_through_slotfiles_uses_the_mapping_made_ahead(tmp_path, monkeypatch):
    _slot(tmp_path, 0, 1, bytes(range(256)) * 32)
    premapped.look(tmp_path, 0, pin=False)
    taken = []
    original = premapped.take

    def recording(path, size):
        found = original(path, size)
        taken.append(found)
        return found

    monkeypatch.setattr(premapped, "take", recording)
    files = SlotFiles(tmp_path, 0, 1)
    buffer = files.mapped(8192)
    assert taken == [buffer] and buffer is not None
    assert bytes(buffer._mapping()[:256]) == bytes(range(256))
    files.release()


def test_a_slot_recreated_or_resized_or_removed_is_let_go(tmp_path):
    _slot(tmp_path, 0, 0, b"x" * 8192)
    _slot(tmp_path, 0, 1, b"y" * 8192)
    premapped.look(tmp_path, 0, pin=False)
    assert len(premapped.held()) == 2
    os.unlink(tmp_path / "rank_0.1")  # its worker discarded it
    _slot(tmp_path, 0, 0, b"z" * 8192)  # rewritten in place: same inode, same size
    premapped.look(tmp_path, 0, pin=False)
    assert list(premapped.held()) == [str(tmp_path / "rank_0.0")]
    (tmp_path / "rank_0.0").unlink()
    _slot(tmp_path, 0, 0, b"w" * 8192)  # a new file (a new inode): mapped again
    premapped.look(tmp_path, 0, pin=False)
    taken = premapped.take(tmp_path / "rank_0.0", 8192)
    assert taken is not None and bytes(taken._mapping()[:4]) == b"wwww"
    taken.close()


def test_a_mapping_is_not_handed_over_for_another_size_or_a_changed_file(tmp_path):
    _slot(tmp_path, 0, 0, b"x" * 8192)
    premapped.look(tmp_path, 0, pin=False)
    assert premapped.take(tmp_path / "rank_0.0", 4096) is None  # the worker's state is another size
    assert premapped.held() == {}
    premapped.look(tmp_path, 0, pin=False)
    with open(tmp_path / "rank_0.0", "ab") as grown:
        grown.write(b"more")
    assert premapped.take(tmp_path / "rank_0.0", 8192) is None  # it changed since: not that file
    assert premapped.take(tmp_path / "rank_9.0", 8192) is None  # never mapped


def test_a_discarded_slot_lets_go_of_its_mapping_made_ahead(tmp_path):
    _slot(tmp_path, 0, 0, b"x" * 8192)
    premapped.look(tmp_path, 0, pin=False)
    SlotFiles(tmp_path, 0, 0).discard()
    assert premapped.held() == {}
    assert not (tmp_path / "rank_0.0").exists()


def test_an_empty_or_missing_folder_maps_nothing(tmp_path):
    premapped.look(tmp_path / "missing", 0, pin=False)
    (tmp_path / "rank_0.0").write_bytes(b"")
    premapped.look(tmp_path, 0, pin=False)
    assert premapped.held() == {}


def test_a_look_stops_before_the_next_slot_when_told(tmp_path):
    _slot(tmp_path, 0, 0, b"x" * 8192)
    _slot(tmp_path, 0, 1, b"y" * 8192)
    answers = iter([True, False])  # the spare's request came after the first slot
    premapped.look(tmp_path, 0, pin=False, go_on=lambda: next(answers))
    assert list(premapped.held()) == [str(tmp_path / "rank_0.0")]
