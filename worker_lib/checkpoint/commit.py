"""The ranks' agreement: the two-phase commit of a step and the vote on which step to load. Ranks
talk through a ``CommitChannel`` (the job's store, never a collective, which would interleave
with the loop's); rank 0 writes the marker once every part is durable, then applies retention.
"""

import json
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from worker_lib.checkpoint.marker import (
    MARKER,
    CommitMarker,
    PartEntry,
    committed_steps,
    step_dir,
    step_markers,
    step_numbers,
)
from worker_lib.checkpoint.retention import CommittedStep, RetentionPolicy
from worker_lib.core.storage import Storage

__all__ = [
    "CheckpointError",
    "CommitChannel",
    "Commits",
    "LocalChannel",
    "StoreChannel",
    "OTHER_SIZE",
    "REFUSED",
]

log = logging.getLogger(__name__)

# Problems every rank stops at: an older step would only hide the cause (a part the weights-only
# loader refuses, per-rank parts of another world size).
REFUSED = "holds objects the weights-only loader refuses"
OTHER_SIZE = "as per-rank parts, which only that many ranks can load"
_STOPS = (REFUSED, OTHER_SIZE)


class CommitChannel(Protocol):
    """How ranks exchange small messages outside collectives."""

    def share(self, key: str, rank: int, value: str) -> None: ...

    def gather(self, key: str, world_size: int, timeout: float) -> List[str]: ...

    def drop(self, key: str, rank: int) -> None: ...


class LocalChannel:
    """A world of one rank: nothing to exchange."""

    def __init__(self) -> None:
        self._values: Dict[str, str] = {}

    def share(self, key: str, rank: int, value: str) -> None:
        self._values[key] = value

    def gather(self, key: str, world_size: int, timeout: float) -> List[str]:
        return [self._values[key]]

    def drop(self, key: str, rank: int) -> None:
        self._values.pop(key, None)


class StoreChannel:
    """Messages through a c10d store, under a prefix unique to this run and attempt."""

    def __init__(self, store: Any, prefix: str) -> None:
        from torch.distributed import PrefixStore

        self._store = PrefixStore(prefix, store)
        self._lock = threading.Lock()  # one store client, used by the save thread and the caller

    def share(self, key: str, rank: int, value: str) -> None:
        with self._lock:
            self._store.set(f"{key}/{rank}", value)

    def gather(self, key: str, world_size: int, timeout: float) -> List[str]:
        from datetime import timedelta

        keys = [f"{key}/{r}" for r in range(world_size)]
        with self._lock:
            self._store.wait(keys, timedelta(seconds=timeout))
            return [value.decode() for value in self._store.multi_get(keys)]  # one round trip

    def drop(self, key: str, rank: int) -> None:
        """Forget this rank's ``key`` once no rank can be waiting for it (a run that shares a
        key every step must not grow the store without end)."""
        with self._lock:
            self._store.delete_key(f"{key}/{rank}")


class CheckpointError(RuntimeError):
    """A save failed in the background, or a checkpoint cannot be read as asked."""


class _Housekeeping:
    """Retention's deletions on a thread of their own, one batch at a time (slow on some disks);
    a failure is tried again after the next commit; non-daemon, so exit waits for the batch."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None

    def start(self, job: Callable[[], None]) -> None:
        self.join()
        self._thread = threading.Thread(target=self._run, args=(job,), name="ftlaunch-retention")
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @staticmethod
    def _run(job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as err:  # noqa: BLE001 - storage errors of any backend
            log.warning("checkpoint retention failed (%s); tried again after the next commit", err)


class Commits:
    """This rank's side of the commit and the load vote."""

    def __init__(
        self,
        storage: Storage,
        rank: int,
        world_size: int,
        channel: CommitChannel,
        retention: RetentionPolicy,
        timeout: float,
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self._channel = channel
        self._retention = retention
        self._timeout = timeout
        self._loads = 0
        self._housekeeping = _Housekeeping()

    def commit(
        self, step: int, written: List[Tuple[str, PartEntry]], metrics: Dict[str, Any], kind: str
    ) -> None:
        """Tell rank 0 this rank's parts are written; rank 0 waits for every rank's, writes the
        marker and applies retention."""
        listed = [{"name": name, **entry.to_json()} for name, entry in written]
        self._channel.share(f"commit/{step}", self.rank, json.dumps(listed))
        if self.rank != 0:
            return
        gathered = self._channel.gather(f"commit/{step}", self.world_size, self._timeout)
        self._write_marker(step, [p for value in gathered for p in json.loads(value)], metrics, kind)
        self._housekeeping.start(lambda: self._apply_retention(step))

    def settle(self) -> None:
        """Wait for retention's deletions of earlier commits (before a write: a nearly full disk
        gets the space back first)."""
        self._housekeeping.join()

    def _write_marker(
        self, step: int, parts: List[Dict[str, Any]], metrics: Dict[str, Any], kind: str
    ) -> None:
        """Rank 0, once every rank's parts are written: the step exists from now on."""
        names = [p["name"] for p in parts]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:  # two ranks wrote the same file: neither copy can be trusted to be "the" one
            raise CheckpointError(f"step {step} not committed: several ranks wrote {', '.join(clashes)}")
        entries: Dict[str, PartEntry] = {}
        for p in parts:
            entry = PartEntry.from_json(p)
            if entry is None:  # each rank shares its PartEntry.to_json(): anything else is a defect
                raise CheckpointError(f"step {step} not committed: a rank listed {p!r}, not a part entry")
            entries[p["name"]] = entry
        marker = CommitMarker(step, self.world_size, kind, entries, metrics)
        self.storage.write_bytes(f"{step_dir(step)}/{MARKER}", marker.to_bytes())
        log.info("checkpoint step %d committed (%d parts)", step, len(parts))

    def _apply_retention(self, newest: int) -> None:
        """Delete what the policy lets go, and uncommitted leftovers older than ``newest``. Steps
        of another world size are neither counted nor deleted: going back to it finds them."""
        found = list(step_markers(self.storage))
        markers = [m for _, m in found if m is not None]
        usable = [CommittedStep(m.step, m.metrics) for m in markers if m.loads_at(self.world_size)]
        doomed = set(self._retention.to_delete(usable))
        marked = {step for step, _ in found}  # a damaged marker's step is kept: it was committed
        doomed |= {s for s in step_numbers(self.storage) if s < newest and s not in marked}
        for step in sorted(doomed):
            self.storage.remove_tree(step_dir(step))
            log.info("checkpoint step %d deleted (retention)", step)

    def barrier(self, name: str) -> None:
        """Return once every rank has called ``barrier(name)``."""
        self._channel.share(f"barrier/{name}", self.rank, "")
        self._channel.gather(f"barrier/{name}", self.world_size, self._timeout)

    def newest_agreed(
        self, read: Callable[[CommitMarker], Tuple[Any, Optional[str]]]
    ) -> Optional[Tuple[CommitMarker, Any]]:
        """(marker, payload) of the newest committed step that ``read`` accepts on every rank;
        None when there is none."""
        self._loads += 1
        for round_, marker in enumerate(committed_steps(self.storage)):
            step = marker.step
            payload, problem = read(marker)
            key = f"load/{self._loads}/{round_}"
            self._channel.share(key, self.rank, f"{step}:{problem or 'ok'}")
            votes = self._channel.gather(key, self.world_size, self._timeout)
            if all(v == f"{step}:ok" for v in votes):
                return marker, payload
            reasons = sorted({v.split(":", 1)[1] for v in votes if v != f"{step}:ok"})
            stopped = [r for r in reasons if any(stop in r for stop in _STOPS)]
            if stopped:  # every rank stops here: an older step would only hide the cause
                raise CheckpointError(f"checkpoint step {step}: {stopped[0]}")
            log.warning(
                "checkpoint step %d is not usable (%s): falling back to the previous committed step",
                step,
                "; ".join(reasons),
            )
        return None
