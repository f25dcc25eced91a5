"""The node-local memory tier: each rank's newest snapshots in the supervisor's /dev/shm folder
(``FTLAUNCH_MEMORY_DIR``), which outlives workers and restarts, not the supervisor.

Two slots a rank (``memory_slots``), each a flat buffer, an index and a record written last (no
record: nothing there). The loop waits for the copy only; the index, the record and the vote follow
on the rank's own thread. A rank writes the slot not holding the newest step every rank has, and
waits before its next write until every rank shared its last, so a crash mid-copy (or before the
record) loses only that copy. A load takes the newest step every rank holds at this world size,
if storage has none newer.
"""

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from worker_lib.checkpoint.commit import CheckpointError, CommitChannel
from worker_lib.checkpoint.flat import decode_index, encode_index, rebuild, split
from worker_lib.checkpoint.memory_slots import Finisher, NoRoom, Record, SlotFiles
from worker_lib.checkpoint.staging import MIN_SIZE, copy_in, mib

__all__ = ["MemorySnapshots", "Record"]

log = logging.getLogger(__name__)

_SLOTS = (0, 1)
_LONG_WAIT_S = 5.0  # a wait for the last snapshot's vote this long is said (once a process)
_GRACE_S = 60.0  # past the vote's own timeout: the background part is stuck (a write, a sync)


@dataclasses.dataclass
class _Pending:
    """The background part of one snapshot: set ``recorded`` once its record is written (or
    failed), ``settled`` once every rank shared it (or the vote failed)."""

    step: int
    slot: int
    recorded: threading.Event = dataclasses.field(default_factory=threading.Event)
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)
    record_failed: bool = False
    vote_error: Optional[BaseException] = None


class MemorySnapshots:
    """This rank's side of the memory tier. ``channel``: a store client of its own (the storage
    saves' thread never blocks it), or a function opening one at its first use."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        world_size: int,
        channel: Union[CommitChannel, Callable[[], CommitChannel]],
        timeout: float = 1800.0,
    ) -> None:
        self.folder = Path(folder)
        self.rank = rank
        self.world_size = world_size
        self._open_channel = channel if callable(channel) else (lambda: channel)
        self._opened: Optional[CommitChannel] = None
        self._timeout = timeout
        self._slots = [SlotFiles(self.folder, rank, slot) for slot in _SLOTS]
        self._finisher = Finisher(f"ftlaunch-memory-rank{rank}")
        self._agreed: Optional[Tuple[int, int]] = None  # (step, slot) that every rank holds
        self._pending: Optional[_Pending] = None  # the last snapshot, while its background part may run
        self._said_long_wait = False
        self._loads = 0
        self._kind = "parts"  # of the load in progress
        self._logged_size = False
        self.read_ahead = False  # the last read's slot was mapped (and registered) ahead by a warm spare

    @property
    def _channel(self) -> CommitChannel:
        if self._opened is None:
            self._opened = self._open_channel()
        return self._opened

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, payload: Any, metrics: Dict[str, float], kind: str = "parts") -> None:
        """Copy ``payload`` into the free slot now (CUDA tensors: the copy is enqueued); its index,
        record and vote follow on this rank's thread. The other slot stays whole whatever happens."""
        self._settle()
        slot = 1 - self._agreed[1] if self._agreed is not None else 0
        files = self._slots[slot]
        files.record.unlink(missing_ok=True)  # the slot's old contents stop counting before they change
        parts = split(payload, copy_objects=False)
        layout = parts.layout
        try:
            index = encode_index(layout, parts.skeleton)  # the state's other objects, as they are now
            buffer = files.buffer_for(max(layout.size, MIN_SIZE))
            if parts.on_cuda:
                buffer.pin()
            events = _fill(parts.tensors, buffer.views(layout))
        except NoRoom as err:
            files.discard()
            raise CheckpointError(self._no_room(err)) from None
        except BaseException:
            files.discard()
            raise
        self._log_size_once(buffer.size, buffer.pinned)
        record = Record(step, kind, self.world_size, buffer.size, len(index), metrics)
        pending = self._pending = _Pending(step, slot)
        self._finisher.submit(lambda: self._finish(files, index, record, events, pending))

    def _finish(
        self, files: SlotFiles, index: bytes, record: Record, events: Sequence[Any], pending: _Pending
    ) -> None:
        """The background part: the index, then the record (the step is whole here from now
        on), this rank's share, then every rank's (only then may the older slot be rewritten)."""
        try:
            try:
                self._write(files, index, record, events)
            except BaseException:
                pending.record_failed = True
                raise  # the next call raises it (the Finisher's)
            finally:
                pending.recorded.set()
            self._vote(pending)
        finally:
            pending.settled.set()

    def _write(self, files: SlotFiles, index: bytes, record: Record, events: Sequence[Any]) -> None:
        for event in events:
            event.synchronize()
        _moment("copied", record.step)
        files.write_index(index)
        _moment("indexed", record.step)
        files.write_record(record)
        _moment("recorded", record.step)
        self._channel.share(f"mem/{record.step}", self.rank, "1")
        _moment("shared", record.step)

    def _vote(self, pending: _Pending) -> None:
        """Wait until every rank has shared ``pending``'s step; a failure is raised by the next save,
        as when the vote ran in it."""
        try:
            self._channel.gather(f"mem/{pending.step}", self.world_size, self._timeout)
        except Exception as err:  # noqa: BLE001 - the store's errors, of any kind
            pending.vote_error = err
            return
        if self._agreed is not None:
            # Every rank shared this step, so every rank is past its wait for the step before.
            self._channel.drop(f"mem/{self._agreed[0]}", self.rank)
        self._agreed = (pending.step, pending.slot)

    def _settle(self) -> None:
        """Wait until the last snapshot's background part is over (every rank shared its step):
        only then may the slot of the step before it be overwritten. Raises its failure."""
        pending = self._pending
        if pending is None:
            return
        self._wait(pending.settled, pending.step)
        self._pending = None
        self._finisher.wait()  # its record's failure: the slot holds nothing
        if pending.vote_error is not None:
            raise pending.vote_error

    def _wait(self, done: threading.Event, step: int) -> None:
        """Wait for ``done`` of ``step``'s background part: bounded by the vote's timeout, and
        said once a process when it is long (a rank behind, or a slow /dev/shm)."""
        started = time.monotonic()
        deadline = started + self._timeout + _GRACE_S
        if done.wait(_LONG_WAIT_S):
            return
        if not self._said_long_wait:
            self._said_long_wait = True
            log.warning(
                "rank %d waits for its memory snapshot of step %d to be recorded and held by every rank "
                "(%.0f s so far; said once): a rank is behind, or its snapshots are slow",
                self.rank,
                step,
                time.monotonic() - started,
            )
        while not done.wait(1.0):  # in slices: a signal's handler runs between them
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"rank {self.rank}: the memory snapshot of step {step} did not end in "
                    f"{self._timeout + _GRACE_S:.0f} s"
                )

    def _no_room(self, err: NoRoom) -> str:
        return (
            f"rank {self.rank}: no room for its memory snapshot in {self.folder.parent} ({mib(err.asked)} "
            f"asked, {mib(err.free)} free; each rank keeps two): give /dev/shm more room (docker: "
            "--shm-size) or save to storage only"
        )

    def _log_size_once(self, size: int, pinned: bool) -> None:
        if not self._logged_size:
            self._logged_size = True
            log.info(
                "rank %d: memory snapshots in two slots of %s each in %s%s",
                self.rank,
                mib(size),
                self.folder,
                ", registered with CUDA as pinned memory" if pinned else "",
            )

    def flush(self) -> None:
        """Wait until the last snapshot's record is written (not for the other ranks: a rank
        that died before its share must not hold this one at its exit)."""
        pending = self._pending
        if pending is None:
            return
        self._wait(pending.recorded, pending.step)
        if pending.record_failed:
            self._settle()  # raises it

    def close(self) -> None:
        """Flush, then unmap the slots (the files stay, for the next worker)."""
        try:
            self.flush()
        finally:
            for files in self._slots:
                files.release()

    # -- loading ----------------------------------------------------------------------------

    def held(self, kind: str = "parts") -> Dict[int, int]:
        """step → slot of this rank's whole snapshots of ``kind`` taken at this world size (the
        last one once its record is written)."""
        self.flush()
        found = {}
        for slot, files in zip(_SLOTS, self._slots):
            record = files.read_record()
            if record is not None and record.world_size == self.world_size and record.kind == kind:
                found[record.step] = slot
        return found

    def newest_agreed(self, storage_newest: Optional[int], kind: str = "parts") -> Optional[int]:
        """The newest step of ``kind`` every rank holds, if at least as new as ``storage_newest``;
        every rank gets the same answer."""
        self._settle()
        self._loads += 1
        key = f"memload/{self._loads}"
        held = self.held(kind)
        self._kind = kind
        self._channel.share(key, self.rank, json.dumps({"steps": sorted(held), "storage": storage_newest}))
        votes = [json.loads(v) for v in self._channel.gather(key, self.world_size, self._timeout)]
        common = set(votes[0]["steps"]).intersection(*(v["steps"] for v in votes[1:]))
        stored = [v["storage"] for v in votes if v["storage"] is not None]
        if not common or (stored and max(common) < max(stored)):
            return None
        return max(common)

    def read(self, step: int, fresh: bool = True) -> Tuple[Any, Optional[str]]:
        """(payload, problem) of this rank's snapshot of ``step``, a CUDA tensor onto this rank's
        device. ``fresh=False``: tensors are views of the slot, for a caller copying them at once."""
        slot = self.held(self._kind).get(step)
        if slot is None:
            return None, f"rank {self.rank}: no whole memory snapshot of step {step}"
        files = self._slots[slot]
        try:
            record = files.read_record()
            if record is None:  # its files changed since held() read them
                raise ValueError("its files are no longer whole")
            layout, skeleton = decode_index(files.index.read_bytes())
            tensors = files.read_tensors(record.size, layout, fresh)
            self.read_ahead = files.mapped_ahead
        except Exception as err:  # noqa: BLE001 - any failure to read it is a reason to fall back
            return None, f"rank {self.rank}: memory snapshot of step {step}: {err}"
        return rebuild(skeleton, tensors), None

    def metrics(self, step: int) -> Dict[str, float]:
        return self._record(step).metrics

    def origin(self, step: int) -> str:
        """Where the snapshot of ``step`` came from if not this node's ranks ("node 0's copy of
        node 2": restored by the launcher before this rank started), else ''."""
        return self._record(step).origin

    def _record(self, step: int) -> Record:
        slot = self.held(self._kind)[step]
        record = self._slots[slot].read_record()
        if record is None:  # held() just found it whole: its files changed since
            raise CheckpointError(f"rank {self.rank}: memory snapshot of step {step} changed while loaded")
        return record

    def agree_read(self, ok: bool) -> bool:
        """Whether every rank read its snapshot of the step ``newest_agreed`` chose."""
        key = f"memread/{self._loads}"
        self._channel.share(key, self.rank, "ok" if ok else "no")
        return all(v == "ok" for v in self._channel.gather(key, self.world_size, self._timeout))

    def adopt(self, step: int) -> None:
        """Every rank loaded ``step``: its slot is the one the next snapshot must not touch."""
        self._agreed = (step, self.held(self._kind)[step])

    def forget(self) -> None:
        """The ranks loaded from storage: no snapshot here is known to be everyone's."""
        self._agreed = None


def _moment(name: str, step: int) -> None:
    """A named moment of a snapshot's background part ("copied", "indexed", "recorded",
    "shared"): where a test stops a rank, to see what each moment leaves loadable."""


def _fill(tensors: Sequence[Any], views: Sequence[Any]) -> List[Any]:
    """Copy the state's tensors into the slot (the step a test may cut off half-way)."""
    return copy_in(tensors, views)


def memory_folder() -> Optional[Path]:
    """The supervisor's memory-tier folder, if it gave one."""
    from worker_lib.core import contract as c

    folder = os.environ.get(c.FT_MEMORY_DIR)
    return Path(folder) if folder else None
