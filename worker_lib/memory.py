"""The node-local memory tier: each rank's newest snapshots in shared memory, in a folder that
ftlaunch's supervisor owns (``FTLAUNCH_MEMORY_DIR``, in /dev/shm). It outlives the worker and the
group's restart; it goes with the supervisor (its end, a kill -9: its orphan guard removes it)
and so with the node.

    rank_<r>.<k>        torch.save of {"state", "rng"}; k is 0 or 1 (a double buffer)
    rank_<r>.<k>.json   written after it: step, kind, world size, bytes, metrics. Without it
                        the slot holds nothing: a copy cut off half-way is never read.

A rank writes into the slot that does not hold the newest step every rank is known to have, and
before it writes again it waits until every rank has shared the step it wrote last. So the two
slots of every rank always hold a step that every rank has: a crash during a copy loses only that
copy. A load takes the newest step every rank holds, at the same world size (a snapshot is one
rank's state), and only when it is at least as new as the newest step in storage.
"""

import dataclasses
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from worker_lib.commit import CheckpointError, CommitChannel

__all__ = ["MemorySnapshots", "Snapshot"]

log = logging.getLogger(__name__)

_SLOTS = (0, 1)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    step: int
    kind: str  # "parts" (ft.load_checkpoint()) or "dcp" (load_checkpoint(into=...))
    world_size: int
    size: int  # bytes of the slot's data file
    metrics: Dict[str, float]

    @classmethod
    def from_json(cls, text: str) -> "Snapshot":
        data = json.loads(text)
        return cls(
            int(data["step"]),
            str(data["kind"]),
            int(data["world_size"]),
            int(data["size"]),
            dict(data["metrics"]),
        )


class MemorySnapshots:
    """This rank's side of the memory tier. ``channel``: a channel of its own (a store client that
    the storage saves' background thread never blocks), or a function that opens one: then it is
    opened at its first use, and a script that never snapshots nor loads parts opens none."""

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
        self._agreed: Optional[Tuple[int, int]] = None  # (step, slot) that every rank holds
        self._shared: Optional[Tuple[int, int]] = None  # (step, slot) written, not yet known everywhere
        self._done_with: Optional[int] = None  # a step whose vote no rank can still be waiting for
        self._loads = 0
        self._kind = "parts"  # of the load in progress

    @property
    def _channel(self) -> CommitChannel:
        if self._opened is None:
            self._opened = self._open_channel()
        return self._opened

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, payload: Any, metrics: Dict[str, float], kind: str = "parts") -> None:
        """Copy ``payload`` into the free slot now (its cost is the copy), and say so."""
        self._settle()
        slot = 1 - self._agreed[1] if self._agreed is not None else 0
        data, meta = self._paths(slot)
        meta.unlink(missing_ok=True)  # the slot's old contents stop counting before they change
        self._check_room(slot)
        try:
            # Over the slot's old bytes, not into a truncated file: its pages are reused, not freed
            # and faulted in again (8 MB: 2.5 ms instead of 6).
            with os.fdopen(os.open(data, os.O_RDWR | os.O_CREAT, 0o600), "r+b") as handle:
                _save(payload, handle)
                size = handle.tell()
                handle.truncate()
        except BaseException as err:  # torch's writer wraps a full disk in a RuntimeError
            data.unlink(missing_ok=True)
            if _disk_full(err):
                raise CheckpointError(self._no_room(0)) from None
            raise
        record = {"step": step, "kind": kind, "world_size": self.world_size, "size": size, "metrics": metrics}
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.rename(meta)
        self._channel.share(f"mem/{step}", self.rank, "1")
        self._shared = (step, slot)

    def _settle(self) -> None:
        """Wait until every rank has shared the step this rank wrote last: only then may the slot
        of the step before it be overwritten."""
        if self._shared is not None:
            step, _ = self._shared
            self._channel.gather(f"mem/{step}", self.world_size, self._timeout)
            if self._agreed is not None:
                # Every rank shared ``step``, so every rank is past its wait for the step before.
                self._channel.drop(f"mem/{self._agreed[0]}", self.rank)
            self._agreed, self._shared = self._shared, None

    def _check_room(self, slot: int) -> None:
        """A snapshot about as large as the last one (in the other slot) must fit."""
        data, other = self._paths(slot)[0], self._paths(1 - slot)[0]
        need = other.stat().st_size if other.exists() else 0
        free = shutil.disk_usage(self.folder).free + (data.stat().st_size if data.exists() else 0)
        if need > free:
            raise CheckpointError(self._no_room(need))

    def _no_room(self, need: int) -> str:
        free = shutil.disk_usage(self.folder).free
        wanted = f"about {_size_text(need)}, " if need else ""
        return (
            f"rank {self.rank}: no room for its memory snapshot in {self.folder.parent} ({wanted}"
            f"{_size_text(free)} free; each rank keeps two): give /dev/shm more room (docker: "
            "--shm-size) or save to storage only"
        )

    # -- loading ----------------------------------------------------------------------------

    def held(self, kind: str = "parts") -> Dict[int, int]:
        """step → slot of this rank's whole snapshots of ``kind`` taken at this world size."""
        found = {}
        for slot in _SLOTS:
            data, meta = self._paths(slot)
            try:
                snap = Snapshot.from_json(meta.read_text())
                whole = data.stat().st_size == snap.size
            except (OSError, ValueError, KeyError):
                continue
            if whole and snap.world_size == self.world_size and snap.kind == kind:
                found[snap.step] = slot
        return found

    def newest_agreed(self, storage_newest: Optional[int], kind: str = "parts") -> Optional[int]:
        """The newest step of ``kind`` every rank holds in memory, if it is at least as new as
        ``storage_newest`` (this rank's view of the newest such step in storage); every rank gets
        the same answer."""
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

    def read(self, step: int) -> Tuple[Any, Optional[str]]:
        """(payload, problem) of this rank's snapshot of ``step``."""
        slot = self.held(self._kind).get(step)
        if slot is None:
            return None, f"rank {self.rank}: no whole memory snapshot of step {step}"
        import torch

        try:
            # Not the weights-only loader: the folder is the supervisor's, private to its user
            # (0700), and written only by this job's ranks.
            payload = torch.load(self._paths(slot)[0], map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - any failure to read it is a reason to fall back
            return None, f"rank {self.rank}: memory snapshot of step {step}: {err}"
        return payload, None

    def metrics(self, step: int) -> Dict[str, float]:
        slot = self.held(self._kind)[step]
        return Snapshot.from_json(self._paths(slot)[1].read_text()).metrics

    def agree_read(self, ok: bool) -> bool:
        """Whether every rank read its snapshot of the step ``newest_agreed`` chose."""
        key = f"memread/{self._loads}"
        self._channel.share(key, self.rank, "ok" if ok else "no")
        return all(v == "ok" for v in self._channel.gather(key, self.world_size, self._timeout))

    def adopt(self, step: int) -> None:
        """Every rank loaded ``step``: its slot is the one the next snapshot must not touch."""
        self._agreed, self._shared = (step, self.held(self._kind)[step]), None

    def forget(self) -> None:
        """The ranks loaded from storage: no snapshot here is known to be everyone's."""
        self._agreed = self._shared = None

    def _paths(self, slot: int) -> List[Path]:
        data = self.folder / f"rank_{self.rank}.{slot}"
        return [data, self.folder / f"rank_{self.rank}.{slot}.json"]


def _save(payload: Any, handle) -> None:
    """torch.save without its zip records' CRC-32, where torch lets us (2.6+): it doubled the
    copy's time (8 MB into /dev/shm: 11 ms, 6 ms without), and the record's size already tells a
    whole snapshot from a torn one in memory that no disk can damage."""
    import contextlib

    import torch

    try:
        from torch.utils.serialization import config

        no_crc = config.patch({"save.compute_crc32": False})
    except (ImportError, AttributeError):
        no_crc = contextlib.nullcontext()
    with no_crc:
        torch.save(payload, handle)


def _disk_full(err: BaseException) -> bool:
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err = err.__cause__ or err.__context__
    return False


def memory_folder() -> Optional[Path]:
    """The supervisor's memory-tier folder, if it gave one."""
    from worker_lib import contract as c

    folder = os.environ.get(c.FT_MEMORY_DIR)
    return Path(folder) if folder else None


def _size_text(count: int) -> str:
    """A size for a person: "240 KiB", "3.5 MiB", "12 GiB", never "0 MiB" for a small one."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            value = count / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{count} bytes"
