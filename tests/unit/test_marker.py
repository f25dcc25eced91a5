"""The COMMITTED marker as one typed record, and what retention makes of markers of another world
size; on a real local directory, with the commit channel of a single rank."""

import json

import google_crc32c
import pytest

from worker_lib.checkpoint.commit import Commits, LocalChannel
from worker_lib.checkpoint.marker import (
    MARKER,
    CommitMarker,
    PartEntry,
    committed_steps,
    step_dir,
    step_numbers,
)
from worker_lib.checkpoint.retention import RetentionPolicy
from worker_lib.core.storage import Storage

_PART = {"rank_0.pt": PartEntry(12, "0a1b2c3d")}


def test_a_marker_reads_back_as_written():
    marker = CommitMarker(20, 2, "state", _PART, {"loss": 0.5}, 1795557623.5)
    assert CommitMarker.parse(marker.to_bytes(), 20) == marker
    raw = json.loads(marker.to_bytes())
    assert raw["parts"] == {"rank_0.pt": {"size": 12, "crc32c": "0a1b2c3d"}} and raw["world_size"] == 2


def test_a_marker_of_an_earlier_version_lists_sha256_and_keeps_it():
    older = b'{"step": 5, "world_size": 1, "parts": {"rank_0.pt": {"size": 1, "sha256": "00ff"}}}'
    marker = CommitMarker.parse(older, 5)
    assert marker.parts["rank_0.pt"] == PartEntry(1, "00ff", "sha256")
    assert json.loads(marker.to_bytes())["parts"] == {"rank_0.pt": {"size": 1, "sha256": "00ff"}}


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{",
        b"[]",
        b'{"step": 21, "world_size": 2, "parts": {}}',  # another step's marker
        b'{"step": 20, "world_size": "2", "parts": {}}',
        b'{"step": 20, "world_size": 2, "parts": []}',
        b'{"step": 20, "world_size": 2, "parts": {"rank_0.pt": {"size": 12}}}',
        b'{"step": 20, "world_size": 2, "parts": {"rank_0.pt": {"size": "12", "sha256": "x"}}}',
        b'{"step": 20, "world_size": 2, "parts": {"rank_0.pt": {"size": 12, "md5": "x"}}}',
        b'{"step": 20, "world_size": 2, "parts": {"rank_0.pt": {"size": 12, "crc32c": 7}}}',
        b'{"step": 20, "world_size": 2, "parts": {}, "time": "now"}',
        b'{"step": 20, "world_size": 2, "parts": {}, "metrics": [1]}',
        # run.json takes a commit's time, and its reader refuses these: a run that read them
        # wrote a run.json no launch could resume
        b'{"step": 20, "world_size": 2, "parts": {}, "time": NaN}',
        b'{"step": 20, "world_size": 2, "parts": {}, "time": 1e308}',
        b'{"step": 20, "world_size": 2, "parts": {}, "time": -1}',
        b'{"step": 20, "world_size": 2, "parts": {}, "time": true}',
        b'{"step": 20, "world_size": true, "parts": {}}',
        b'{"step": 20, "world_size": 0, "parts": {}}',
        b'{"step": 20, "world_size": 2, "parts": {"rank_0.pt": {"size": -1, "crc32c": "00"}}}',
        b'{"step": 20, "world_size": 2, "parts": {"rank_0.pt": {"size": true, "crc32c": "00"}}}',
    ],
)
def test_a_damaged_or_foreign_marker_is_no_commit(damage):
    assert CommitMarker.parse(damage, 20) is None


def test_an_older_marker_without_kind_metrics_or_time_is_read_with_defaults():
    older = b'{"step": 5, "world_size": 1, "parts": {"rank_0.pt": {"size": 1, "sha256": "00"}}}'
    marker = CommitMarker.parse(older, 5)
    assert (marker.kind, marker.metrics, marker.time) == ("state", {}, 0.0)


def test_which_world_sizes_can_load_a_step():
    assert CommitMarker(5, 2, "state", _PART).loads_at(2)
    assert not CommitMarker(5, 2, "state", _PART).loads_at(1)
    assert not CommitMarker(5, 2, "directory", _PART).loads_at(1)  # its RNG parts are per rank
    assert CommitMarker(5, 2, "replicated", _PART).loads_at(1)
    assert CommitMarker(5, 2, "dcp", _PART).loads_at(3)  # resharded by torch.distributed.checkpoint


def _part(storage: Storage, step: int) -> PartEntry:
    data = f"step {step}".encode()
    storage.write_bytes(f"{step_dir(step)}/rank_0.pt", data)
    return PartEntry(len(data), f"{google_crc32c.value(data):08x}")


def test_retention_never_deletes_usable_steps_for_steps_of_another_world_size(tmp_path):
    """Issue 22.4: steps 55 and 60 were saved by 2 ranks; a relaunch with 1 rank saves 5..30.
    Its own steps are kept by keep_last, and the 2-rank steps are neither counted nor deleted."""
    storage = Storage(str(tmp_path / "ckpt"))
    for step in (55, 60):  # as a 2-rank job's rank 0 wrote them
        marker = CommitMarker(step, 2, "state", {"rank_0.pt": _part(storage, step)})
        storage.write_bytes(f"{step_dir(step)}/{MARKER}", marker.to_bytes())
    commits = Commits(storage, 0, 1, LocalChannel(), RetentionPolicy(keep_last=2), timeout=5.0)
    for step in (5, 10, 15, 20, 25, 30):
        commits.commit(step, [("rank_0.pt", _part(storage, step))], {}, "state")
    commits.settle()  # retention deletes in the background
    assert step_numbers(storage) == [25, 30, 55, 60]
    assert [m.step for m in committed_steps(storage)] == [60, 55, 30, 25]


def test_per_rank_parts_of_another_world_size_are_an_error_naming_the_way_out(tmp_path):
    """Issue 24.3: never a silent fresh start. Per-rank parts saved by 2 ranks, loaded by 1: an
    error (on every rank: each votes it, and the vote stops there) that names the way out."""
    from worker_lib.checkpoint.manager import CheckpointError, CheckpointManager

    storage = Storage(str(tmp_path))
    entry = _part(storage, 5)  # rank 0's part (rank 1's is not read: rank 0 votes first)
    parts = {"rank_0.pt": entry, "rank_1.pt": entry}
    storage.write_bytes(f"{step_dir(5)}/{MARKER}", CommitMarker(5, 2, "state", parts).to_bytes())
    alone = CheckpointManager(storage, 0, 1, LocalChannel())
    with pytest.raises(CheckpointError, match="step 5: saved by 2 ranks as per-rank parts.*replicated=True"):
        alone.load()


def test_only_the_step_folders_ftlaunch_names_are_steps(tmp_path):
    """step_007 and step_\uff17 read as 7 through int(): they are someone else's folders, never
    counted (the run's end would call them step 7's lost save) nor removed."""
    storage = Storage(str(tmp_path / "ckpt"))
    for name in ("step_7", "step_007", "step_\uff17", "step_\u0663", "step_x", "step_", "step_-1"):
        storage.write_bytes(f"{name}/rank_0.pt", b"x")
    assert step_numbers(storage) == [7]


def test_a_step_whose_marker_is_damaged_is_said_once_skipped_and_never_deleted(tmp_path, caplog):
    """Its parts were committed once: neither retention (uncommitted leftovers older than the
    newest commit) nor the run's end (parts without a marker) deletes them."""
    from launcher.runs.checkpoints import CheckpointDir

    storage = Storage(str(tmp_path / "ckpt"))
    damaged = f"{step_dir(5)}/{MARKER}"
    storage.write_bytes(damaged, CommitMarker(5, 1, "state", {"rank_0.pt": _part(storage, 5)}).to_bytes())
    storage.write_bytes(damaged, storage.read_bytes(damaged)[:-9])  # torn
    _part(storage, 7)  # a save cut off: no marker at all
    commits = Commits(storage, 0, 1, LocalChannel(), RetentionPolicy(keep_last=2), timeout=5.0)
    commits.commit(10, [("rank_0.pt", _part(storage, 10))], {}, "state")
    commits.settle()
    assert step_numbers(storage) == [5, 10]  # step 7's leftover went, step 5 stays
    assert [m.step for m in committed_steps(storage)] == [10]
    _part(storage, 12)
    removed = CheckpointDir(storage.root, 1).remove_uncommitted()
    assert removed.steps == [12] and removed.newest_committed == 10 and step_numbers(storage) == [5, 10]
    said = [r.message for r in caplog.records if "step_5" in r.message]
    assert said == [
        f"checkpoint {storage.path(damaged)} is not one ftlaunch writes: the step is skipped, and kept"
    ]
