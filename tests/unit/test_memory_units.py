"""The memory tier's double buffer and its votes (worker_lib.checkpoint.memory), two ranks in one process
sharing one message board: what a crash at each moment leaves loadable."""

import json
import threading
import time

import pytest
import torch

from worker_lib.checkpoint.commit import CheckpointError
from worker_lib.checkpoint.memory import MemorySnapshots


class Board:
    """The ranks' messages (what the job's store carries between processes); a gather waits, as
    the store's does, up to its timeout."""

    def __init__(self) -> None:
        self.values = {}

    def share(self, key, rank, value):
        self.values[f"{key}/{rank}"] = value

    def gather(self, key, world_size, timeout):
        keys = [f"{key}/{r}" for r in range(world_size)]
        deadline = time.monotonic() + timeout
        while not all(k in self.values for k in keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key} from every rank")
            time.sleep(0.005)
        return [self.values[k] for k in keys]

    def drop(self, key, rank):
        del self.values[f"{key}/{rank}"]


def _ranks(folder, world_size=2):
    board = Board()
    return [MemorySnapshots(folder, r, world_size, board, timeout=1.0) for r in range(world_size)], board


def _each(ranks, call):
    """``call(snapshots)`` on every rank at once (their votes wait for each other)."""
    results = [None] * len(ranks)

    def run(i):
        results[i] = call(ranks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("the copy is cut off here")


def _save(snaps, step):
    snaps.save(step, {"state": {"w": torch.full((4,), float(step))}, "rng": None}, {"loss": 1.0 / step})


def _save_all(ranks, step):
    for snaps in ranks:
        _save(snaps, step)
    for snaps in ranks:  # each record follows the call, on the rank's thread: what a test reads next
        snaps.flush()


def test_two_slots_hold_the_newest_two_steps_and_a_load_takes_the_newest(tmp_path):
    ranks, _ = _ranks(tmp_path)
    for step in (1, 2, 3):
        _save_all(ranks, step)
    assert [sorted(s.held()) for s in ranks] == [[2, 3], [2, 3]]
    again, _ = _ranks(tmp_path)  # the restarted group's ranks
    assert _each(again, lambda s: s.newest_agreed(storage_newest=None)) == [3, 3]
    payload, problem = again[1].read(3)
    assert problem is None and torch.equal(payload["state"]["w"], torch.full((4,), 3.0))
    assert again[0].metrics(3) == {"loss": 1.0 / 3}


def test_a_copy_cut_off_half_way_loses_only_that_copy(tmp_path):
    """Rank 1's copy of step 4 fails half-way (as if it died there): its slot of step 2 holds
    half a file and no record; step 3 is whole on both ranks and is what a restart loads."""
    ranks, _ = _ranks(tmp_path)
    for step in (1, 2, 3):
        _save_all(ranks, step)
    ranks[0].save(4, {"state": {"w": torch.zeros(4)}, "rng": None}, {})
    with pytest.raises(RuntimeError, match="cut off"):
        ranks[1].save(4, {"state": {"w": torch.zeros(4), "x": Unpicklable()}, "rng": None}, {})
    assert sorted(ranks[0].held()) == [3, 4] and sorted(ranks[1].held()) == [3]
    again, _ = _ranks(tmp_path)
    assert _each(again, lambda s: s.newest_agreed(None)) == [3, 3]


def test_a_rank_never_overwrites_a_step_before_every_rank_has_the_next(tmp_path):
    """Rank 0 cannot run two snapshots ahead: its next save waits for rank 1's share of the last."""
    ranks, _ = _ranks(tmp_path)
    _save_all(ranks, 1)
    ranks[0].save(2, {"state": {}, "rng": None}, {})
    with pytest.raises(TimeoutError):  # rank 1 never shared step 2
        ranks[0].save(3, {"state": {}, "rng": None}, {})
    assert sorted(ranks[0].held()) == [1, 2]  # step 1, the step every rank has, is intact


def test_storage_newer_than_memory_wins_and_another_world_size_is_not_loaded(tmp_path):
    ranks, _ = _ranks(tmp_path)
    _save_all(ranks, 5)
    again, _ = _ranks(tmp_path)
    assert _each(again, lambda s: s.newest_agreed(storage_newest=10)) == [None, None]
    again, _ = _ranks(tmp_path)
    assert _each(again, lambda s: s.newest_agreed(storage_newest=5)) == [5, 5]  # a tie: memory, faster
    bigger, _ = _ranks(tmp_path, world_size=3)
    assert bigger[0].held() == {}  # rank 0's snapshot of a 2-rank job


def test_a_damaged_record_or_a_short_file_is_not_held(tmp_path):
    ranks, _ = _ranks(tmp_path, world_size=1)
    _save_all(ranks, 1)
    _save_all(ranks, 2)
    (tmp_path / "rank_0.0.json").write_text("{not json")
    data = tmp_path / "rank_0.1"
    data.write_bytes(data.read_bytes()[:-10])
    assert ranks[0].held() == {}
    record = json.loads((tmp_path / "rank_0.1.json").read_text())
    assert record["step"] == 2 and record["world_size"] == 1


def test_the_memory_tier_needs_ftlaunch():
    from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
    from worker_lib.core.storage import Storage

    manager = CheckpointManager(Storage("memory://nowhere"), 0, 1, LocalChannel())
    with pytest.raises(CheckpointError, match="to='memory' needs ftlaunch's node-local memory tier"):
        manager.snapshot(1, {"w": torch.ones(1)})


def test_the_votes_of_old_steps_leave_the_store(tmp_path):
    """A snapshot every step must not grow the job's store without end: a rank's vote on a step
    goes once every rank has voted on the next one (on the rank's thread, right after its own)."""
    ranks, board = _ranks(tmp_path)
    for step in range(1, 6):
        _save_all(ranks, step)
    _each(ranks, lambda s: s._settle())  # each rank's vote on step 5 is over
    assert sorted(board.values) == ["mem/5/0", "mem/5/1"]


@pytest.mark.parametrize(
    "count, text",
    [
        (900, "1 KiB"),
        (245_760, "240 KiB"),
        (3 * 2**20 + 2**19, "4 MiB"),
        (12 * 2**30, "12.0 GiB"),
    ],
)
def test_a_size_below_a_mib_is_not_said_as_0_mib(count, text):
    """Regression (issue 33): "about 0 MiB, 0 MiB free" on a small /dev/shm."""
    from worker_lib.checkpoint.staging import mib

    assert mib(count) == text


class _Died(BaseException):
    """A rank's snapshot thread stops here, as its process would at a crash."""


def _die_at(monkeypatch, moment, step, dying_rank):
    """``dying_rank``'s snapshot thread stops at ``moment`` of its background part of ``step``."""
    from worker_lib.checkpoint import memory

    def moment_of(name, at):
        if (name, at) == (moment, step) and threading.current_thread().name.endswith(f"rank{dying_rank}"):
            raise _Died(name)

    monkeypatch.setattr(memory, "_moment", moment_of, raising=False)


def test_a_snapshot_blocks_the_loop_for_its_copy_only(tmp_path, monkeypatch):
    """Issue 51.5: save returns once the state is in the slot; the index, the record and the
    rank's vote come after, on the rank's own thread (here held at its start until released)."""
    from worker_lib.checkpoint import memory

    released = threading.Event()
    monkeypatch.setattr(memory, "_moment", lambda name, step: released.wait(10), raising=False)
    loop = threading.current_thread()
    calls = []

    class Watched(Board):
        def share(self, key, rank, value):
            calls.append(threading.current_thread() is loop)
            super().share(key, rank, value)

        def gather(self, key, world_size, timeout):
            calls.append(threading.current_thread() is loop)
            return super().gather(key, world_size, timeout)

    snaps = MemorySnapshots(tmp_path, 0, 1, Watched(), timeout=1.0)
    snaps.save(1, {"state": {"w": torch.full((4,), 1.0)}, "rng": None}, {})
    assert not (tmp_path / "rank_0.0.json").exists()  # the record is not the loop's to write
    assert not (tmp_path / "rank_0.0.index").exists()
    released.set()
    snaps.save(2, {"state": {"w": torch.full((4,), 2.0)}, "rng": None}, {})  # waits for step 1's part
    assert snaps.held() == {1: 0, 2: 1}
    snaps._settle()
    assert calls == [False] * 4  # each step's share and gather, none on the loop's thread
    snaps.close()


@pytest.mark.parametrize("moment, loaded", [("copied", 2), ("indexed", 2), ("recorded", 3), ("shared", 3)])
def test_a_crash_in_the_background_part_loads_the_newest_step_every_rank_completed(
    tmp_path, monkeypatch, moment, loaded
):
    """Rank 1 dies at each moment of its snapshot of step 3's background part, rank 0 holding
    step 3: before the record, step 3 does not count on rank 1 and both load 2; after it, 3 is
    whole on both. Never a torn step: what loads holds that step's values."""
    ranks, _ = _ranks(tmp_path)
    for step in (1, 2):
        _save_all(ranks, step)
    _die_at(monkeypatch, moment, 3, dying_rank=1)
    for snaps in ranks:
        _save(snaps, 3)
    with pytest.raises(CheckpointError):  # once rank 1's thread reached the moment (it follows the call)
        ranks[1].flush()
    assert sorted(ranks[0].held()) == [2, 3]  # rank 0 may not overwrite 2 until rank 1 shares 3
    again, _ = _ranks(tmp_path)  # the restarted group's ranks
    assert _each(again, lambda s: s.newest_agreed(storage_newest=None)) == [loaded, loaded]
    for snaps in again:
        payload, problem = snaps.read(loaded)
        assert problem is None and torch.equal(payload["state"]["w"], torch.full((4,), float(loaded)))


def test_a_long_wait_for_the_last_snapshot_is_said_once(tmp_path, monkeypatch):
    """The next save waits for the last snapshot's background part; a long wait is said, once
    a process. Here "long" is 50 ms: step 1's part is held until the line is said, step 2's for
    0.3 s (said no more)."""
    import logging

    from worker_lib.checkpoint import memory

    monkeypatch.setattr(memory, "_LONG_WAIT_S", 0.05)
    said_it = threading.Event()
    holds = {1: lambda: said_it.wait(10), 2: lambda: threading.Event().wait(0.3)}
    monkeypatch.setattr(memory, "_moment", lambda name, step: name == "copied" and holds.get(step, bool)())
    said = []

    class Told(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
            said_it.set()

    handler = Told(logging.WARNING)
    memory.log.addHandler(handler)
    try:
        snaps = MemorySnapshots(tmp_path, 0, 1, Board(), timeout=1.0)
        for step in (1, 2, 3):
            snaps.save(step, {"state": {"w": torch.full((4,), float(step))}, "rng": None}, {})
        snaps.close()
    finally:
        memory.log.removeHandler(handler)
    assert said == [
        "rank 0 waits for its memory snapshot of step 1 to be recorded and held by every rank (0 s so "
        "far; said once): a rank is behind, or its snapshots are slow"
    ]
    assert sorted(snaps.held()) == [2, 3]
