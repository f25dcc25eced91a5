"""The node's memory tier: the folder in /dev/shm where this supervisor's workers keep their
memory snapshots (worker_lib.checkpoint.memory). It is the supervisor's, not a worker's: made when the
supervisor starts, removed when it ends, and by its orphan guard when it is killed; a later
supervisor on the node removes any that no live supervisor holds (the guard killed too:
launcher.core.owned, whose lock holds across PID namespaces)."""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from launcher.core.health import CheckResult, tier_room_needed
from launcher.core.owned import owned_folder, remove_unowned

__all__ = ["HeldSlot", "MemoryTier", "drop_own_tiers", "held_slots", "room_for_tier", "snapshot_room_needed"]

_KIND = "ftlaunch-memory-"  # then owned-, the supervisor's pid and a random suffix
_SHM = Path("/dev/shm")


class MemoryTier:
    """``folder`` is None where the node has no writable /dev/shm: then there is no memory tier
    (a worker's ``to="memory"`` says so), never a disk pretending to be memory."""

    def __init__(self, shm: Path = _SHM) -> None:
        self.folder: Optional[Path] = None
        self._lock = -1  # the fd whose flock says the folder is in use, while it exists
        if not os.access(shm, os.W_OK):
            return
        remove_unowned(shm, _KIND)
        try:
            self._lock, self.folder = owned_folder(shm, _KIND)  # mode 0700
        except OSError:  # no room for even a folder: no memory tier, as without /dev/shm
            self.folder = None

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # still locked: no cleaner races it
            os.close(self._lock)
            self.folder = None


def drop_own_tiers(shm: Path = _SHM) -> None:
    """This supervisor's tier folders gone with no goodbye, as a machine's death takes them
    (--chaos kill-node: the orphan guard that would remove them is killed too)."""
    for folder in shm.glob(f"{_KIND}owned-{os.getpid()}-*"):
        shutil.rmtree(folder, ignore_errors=True)


_RECORD = re.compile(r"rank_(\d+)\.(\d+)\.json")  # worker_lib.checkpoint.memory_slots' slot record


@dataclasses.dataclass(frozen=True)
class HeldSlot:
    """One whole slot of the tier as its files say (worker_lib.checkpoint.memory_slots writes
    them: ``rank_<r>.<k>`` the data, ``.index``, and the record ``.json`` last)."""

    rank: int
    slot: int
    step: int
    size: int  # bytes of the data file
    index_size: int
    record: bytes  # the record's text, as written
    record_inode: int  # a rewrite of the slot removes the record first: a new one is a new inode

    def path(self, folder: Path, suffix: str = "") -> Path:
        return folder / f"rank_{self.rank}.{self.slot}{suffix}"


def held_slots(folder: Path, files: bool = True) -> List[HeldSlot]:
    """Each whole slot in ``folder``: a record that reads back, with data and index of its sizes
    (a slot being written, or damaged, is not one). ``files=False``: the records alone."""
    held = []
    for path in folder.glob("rank_*.json"):
        found = _RECORD.fullmatch(path.name)
        if not found:
            continue
        try:
            with open(path, "rb") as handle:
                inode, text = os.fstat(handle.fileno()).st_ino, handle.read()
            record = json.loads(text)
            step, size, index_size = int(record["step"]), int(record["size"]), int(record["index_size"])
            whole = not files or (
                path.with_suffix("").stat().st_size == size
                and path.with_suffix(".index").stat().st_size == index_size
            )
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            continue
        if whole:
            rank, slot = int(found.group(1)), int(found.group(2))
            held.append(HeldSlot(rank, slot, step, size, index_size, text, inode))
    return held


def room_for_tier(folder: Optional[Path]) -> CheckResult:
    """/dev/shm can still take what the tier would hold: two snapshots a rank at the sizes its
    slots show (data and index; the slots made are reserved and stay). Before any snapshot the
    size is not known: unknown, never "room"."""
    name = "memory tier room"
    if folder is None:
        return CheckResult.unknown(name, "no memory tier on this node (no writable /dev/shm)")
    own = tier_room_needed(_slot_sizes(folder))
    if own is None:
        return CheckResult.unknown(name, "no snapshot in the tier yet: its size is not known")
    need = own + _copies_room(folder / "peers")
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    mib = 2**20
    if free < need:
        return CheckResult.failed(
            name,
            f"{folder.parent} has {free / mib:.0f} MiB free, the tier's next snapshots need "
            f"{need / mib:.0f} MiB",
        )
    return CheckResult.passed(name, f"{free / mib:.0f} MiB free, {need / mib:.0f} MiB needed")


def snapshot_room_needed(folder: Path) -> Optional[int]:
    """Bytes the node's own ranks still need for two snapshots each (None: none made yet)."""
    return tier_room_needed(_slot_sizes(folder))


def _copies_room(peers: Path) -> int:
    """What the next copies from other nodes (--memory-peers) need beyond what they hold: as much
    again as the newest of each node's, since a copy arrives whole before the oldest goes
    (launcher.replicas.held's ``peers/ranks_*/copy_*``)."""
    total = 0
    for ranks in peers.glob("ranks_*"):
        sizes = []
        for copy in ranks.glob("copy_*"):
            try:
                sizes.append(sum(f.stat().st_size for f in copy.iterdir()))
            except OSError:  # pruned meanwhile
                continue
        total += max(sizes, default=0)
    return total


def _slot_sizes(folder: Path) -> Dict[int, List[int]]:
    """Each rank's whole slots (a record read back), by size; a slot being written is not counted."""
    sizes: Dict[int, List[int]] = {}
    for held in held_slots(folder, files=False):
        sizes.setdefault(held.rank, []).append(held.size + held.index_size)
    return sizes
