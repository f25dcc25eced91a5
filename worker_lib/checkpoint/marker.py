"""A step's layout in storage and its COMMITTED marker, the one record worker_lib writes and the
launcher reads::

    step_<n>/rank_<r>.pt      each rank's part: its RNG states, and its state unless replicated
    step_<n>/replicated.pt    replicated mode: the state, written once by rank 0
    step_<n>/files/...        directory mode: the files the script wrote
    step_<n>/dcp/...          format="dcp": torch.distributed.checkpoint's files
    step_<n>/COMMITTED        JSON by rank 0, last: the parts' sizes and CRC32C, world size, metrics

A step without a well-formed marker does not exist for readers; a damaged one is said once and
kept (its parts were committed once: nothing deletes them).
"""

import contextlib
import dataclasses
import io
import json
import logging
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set, Tuple, Union

from worker_lib.core import checksum
from worker_lib.core.checksum import CRC32C, Checksum  # PartEntry's field ``checksum`` hides the module
from worker_lib.core.storage import Storage, StorageError

__all__ = [
    "MARKER",
    "REPLICATED",
    "RESHARDABLE",
    "CommitMarker",
    "PartEntry",
    "VerifiedPart",
    "committed_steps",
    "part_name",
    "opened_verified",
    "read_verified",
    "step_dir",
    "step_markers",
    "step_numbers",
]

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
RESHARDABLE = ("replicated", "dcp")  # kinds that load at any world size
REPLICATED = "replicated.pt"
_STEP_PREFIX = "step_"
_LATEST_WALL = 253402300799.0  # 9999-12-31 23:59:59 UTC: a later commit time is no date
_LARGEST_INT = 2**63 - 1  # int64, as torch holds steps and sizes
_said: Set[Tuple[str, int]] = set()  # (storage, step) of damaged markers already warned about


def _count(value: Any, lowest: int) -> bool:
    """An int of the marker (a bool is an int to Python, never to the marker)."""
    return isinstance(value, int) and not isinstance(value, bool) and lowest <= value <= _LARGEST_INT


def step_dir(step: int) -> str:
    return f"{_STEP_PREFIX}{step}"


def part_name(rank: int) -> str:
    return f"rank_{rank}.pt"


@dataclasses.dataclass(frozen=True)
class PartEntry:
    """One written file of a step, as the marker lists it: ``{"size": n, "crc32c": "..."}``
    (markers of earlier versions: ``"sha256"``)."""

    size: int
    checksum: str
    algorithm: str = CRC32C

    def to_json(self) -> Dict[str, Any]:
        return {"size": self.size, self.algorithm: self.checksum}

    @classmethod
    def from_json(cls, entry: Any) -> Optional["PartEntry"]:
        """None for anything ``to_json`` does not write."""
        if not isinstance(entry, dict) or not _count(entry.get("size"), 0):
            return None
        for algorithm in checksum.ALGORITHMS:
            if isinstance(entry.get(algorithm), str):
                return cls(entry["size"], entry[algorithm], algorithm)
        return None

    def problem_with(self, name: str, size: int, summer: Checksum) -> Optional[str]:
        """What is wrong with a file of ``size`` bytes whose checksum ``summer`` holds; None if
        it is the one listed."""
        if size != self.size:
            return f"{name} has {size} bytes, the marker says {self.size}"
        if summer.hexdigest() != self.checksum:
            return f"{name} fails its checksum"
        return None


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    step: int
    world_size: int
    kind: str  # "state" (per-rank parts), "replicated" (one copy by rank 0), "directory" or "dcp"
    parts: Mapping[str, PartEntry]
    metrics: Dict[str, Any] = dataclasses.field(default_factory=dict)
    time: float = dataclasses.field(default_factory=time.time)  # wall clock of the commit

    def loads_at(self, world_size: int) -> bool:
        """Whether ranks of a job of ``world_size`` can load this step: per-rank parts need the
        world size that wrote them; replicated and DCP steps load at any."""
        return self.world_size == world_size or self.kind in RESHARDABLE

    def to_bytes(self) -> bytes:
        record = dataclasses.asdict(self)
        record["parts"] = {name: entry.to_json() for name, entry in self.parts.items()}
        return json.dumps(record, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, step: int) -> Optional["CommitMarker"]:
        """The marker of ``step``; None for anything not of the shape ``to_bytes`` writes (a
        damaged or foreign file): such a step is as if it had never been committed."""
        try:
            raw = json.loads(data)
        except ValueError:
            return None
        if not isinstance(raw, dict) or not _count(raw.get("step"), 0) or raw["step"] != step:
            return None
        if not _count(raw.get("world_size"), 1):
            return None
        parts, when, metrics = raw.get("parts"), raw.get("time", 0.0), raw.get("metrics", {})
        if not isinstance(parts, dict) or not isinstance(metrics, dict):
            return None
        # the commit's wall-clock time: run.json takes it, whose reader refuses NaN and 1e308
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when <= _LATEST_WALL:
            return None
        entries: Dict[str, PartEntry] = {}
        for name, entry in parts.items():
            part = PartEntry.from_json(entry)
            if part is None:
                return None
            entries[name] = part
        kind = raw.get("kind", "state")
        return cls(step, raw["world_size"], str(kind), entries, metrics, float(when))


def step_numbers(storage: Storage) -> List[int]:
    """Every step folder, committed or not, oldest first; only names ``step_dir`` writes (int()
    reads step_007 as 7 too, and a removal of step 7 would miss it)."""
    steps = []
    for name in storage.list_names():
        digits = name[len(_STEP_PREFIX) :]
        if name.startswith(_STEP_PREFIX) and digits.isascii() and digits.isdigit():
            if step_dir(int(digits)) == name:
                steps.append(int(digits))
    return sorted(steps)


def committed_steps(storage: Storage) -> Iterator[CommitMarker]:
    """The committed steps' markers, newest first."""
    return (marker for _, marker in step_markers(storage) if marker is not None)


def step_markers(storage: Storage) -> Iterator[Tuple[int, Optional[CommitMarker]]]:
    """Each step with a marker file, newest first, with its marker; None for a damaged one (said
    once): neither loaded nor deleted."""
    for step in reversed(step_numbers(storage)):
        name = f"{step_dir(step)}/{MARKER}"
        try:
            marker = CommitMarker.parse(storage.read_bytes(name), step)
            problem = "is not one ftlaunch writes"
        except FileNotFoundError:
            continue  # not committed: does not exist for readers
        except StorageError as err:
            marker, problem = None, f"cannot be read ({err})"
        if marker is None and (storage.root, step) not in _said:
            _said.add((storage.root, step))
            log.warning("checkpoint %s %s: the step is skipped, and kept", storage.path(name), problem)
        yield step, marker


def read_verified(
    storage: Storage, step: int, name: str, expected: Optional[PartEntry]
) -> Tuple[bytes, Optional[str]]:
    """A part's bytes and None, or no bytes and what is wrong with it."""
    if expected is None:
        return b"", f"{name} is not listed in the commit marker"
    try:
        data = storage.read_bytes(f"{step_dir(step)}/{name}")
    except FileNotFoundError:
        return b"", f"{name} is missing"
    except StorageError as err:
        return b"", f"{name} cannot be read: {err}"
    summer = checksum.new(expected.algorithm)
    summer.update(data)
    problem = expected.problem_with(name, len(data), summer)
    return (b"", problem) if problem else (data, None)


@dataclasses.dataclass(frozen=True)
class VerifiedPart:
    """A part checked against its marker entry, for ``torch.load``: on local storage the mapped
    file (``mapped``: load with ``mmap=True``), elsewhere the bytes read."""

    source: Union[str, io.BytesIO]
    mapped: bool


@contextlib.contextmanager
def opened_verified(
    storage: Storage, step: int, name: str, expected: Optional[PartEntry]
) -> Iterator[Tuple[Optional[VerifiedPart], Optional[str]]]:
    """(The part, None) or (None, what is wrong with it); the part is valid inside the context."""
    if not storage.is_local:
        data, problem = read_verified(storage, step, name, expected)
        yield (None, problem) if problem else (VerifiedPart(io.BytesIO(data), mapped=False), None)
        return
    if expected is None:
        yield None, f"{name} is not listed in the commit marker"
        return
    with contextlib.ExitStack() as stack:
        try:
            view, path = stack.enter_context(storage.mapped(f"{step_dir(step)}/{name}"))
        except FileNotFoundError:
            yield None, f"{name} is missing"
            return
        except OSError as err:
            yield None, f"{name} cannot be read: {err}"
            return
        summer = checksum.new(expected.algorithm)
        summer.update(view)
        problem = expected.problem_with(name, len(view), summer)
        yield (None, problem) if problem else (VerifiedPart(path, mapped=True), None)
