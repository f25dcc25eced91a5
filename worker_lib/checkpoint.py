"""Per-rank checkpoints with a commit marker written last.

Layout under the storage root::

    step_<n>/rank_<r>.pt      each rank's part: its RNG states, and its state unless replicated
    step_<n>/replicated.pt    replicated mode: the state, written once by rank 0
    step_<n>/COMMITTED        JSON, written by rank 0 once every part is durable: the parts with
                              sizes and SHA-256 checksums, the world size, the metrics

A step without COMMITTED does not exist for readers. Ranks tell rank 0 about their parts through
the job's c10d store (never a collective: the background save thread must not interleave
collectives with the training loop's), and agree on which step to load through it as well.
"""

import atexit
import collections
import dataclasses
import hashlib
import io
import json
import logging
import threading
import time
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

from worker_lib import contract as c
from worker_lib.chaos import act, dying_half_way
from worker_lib.progress import chaos_request
from worker_lib.retention import CommittedStep, RetentionPolicy
from worker_lib.rng import capture_rng, restore_rng
from worker_lib.storage import Storage, StorageError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CommitChannel",
    "LocalChannel",
    "StoreChannel",
]

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
_REFUSED = "holds objects the weights-only loader refuses"
REPLICATED = "replicated.pt"
_STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A save failed in the background, or a checkpoint cannot be read as asked."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    step: int
    state: Any
    metrics: Dict[str, float]


class CommitChannel(Protocol):
    """How ranks exchange small messages outside collectives."""

    def share(self, key: str, rank: int, value: str) -> None: ...

    def gather(self, key: str, world_size: int, timeout: float) -> List[str]: ...


class LocalChannel:
    """A world of one rank: nothing to exchange."""

    def __init__(self) -> None:
        self._values: Dict[str, str] = {}

    def share(self, key: str, rank: int, value: str) -> None:
        self._values[key] = value

    def gather(self, key: str, world_size: int, timeout: float) -> List[str]:
        return [self._values[key]]


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
            return [self._store.get(k).decode() for k in keys]


def step_dir(step: int) -> str:
    return f"{_STEP_PREFIX}{step}"


def part_name(rank: int) -> str:
    return f"rank_{rank}.pt"


class CheckpointManager:
    """Saves and loads this rank's checkpoints; one per process, built by ``worker_lib.init``."""

    def __init__(
        self,
        storage: Storage,
        rank: int,
        world_size: int,
        channel: CommitChannel,
        retention: Optional[RetentionPolicy] = None,
        save_rng: bool = True,
        commit_timeout: float = 1800.0,
        trusted: bool = False,
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self._channel = channel
        self._retention = retention or RetentionPolicy()
        self._save_rng = save_rng
        self._commit_timeout = commit_timeout
        self._trusted = trusted  # unpickle anything; else torch's weights-only loader and its allow-list
        self._thread: Optional[threading.Thread] = None
        # The previous async save's CPU copy: written and done with once wait() returns, so the
        # next save copies into it instead of allocating (and page-faulting) as much memory again.
        self._staging: Any = None
        self._error: Optional[BaseException] = None
        self._failed = ""  # why an earlier save failed: this rank writes no further parts
        self._loads = 0
        atexit.register(self._wait_at_exit)

    # -- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Optional[Dict[str, float]] = None,
        replicated: bool = False,
        blocking: bool = False,
    ) -> None:
        """Copy ``state`` to CPU memory now; write and commit it in the background (or now).

        Once a save of this rank has failed (a full disk, storage gone for good), every later save
        raises at once: parts of steps that can never be committed would only fill the storage."""
        if self._failed:
            raise CheckpointError(f"rank {self.rank} saves no more checkpoints: {self._failed}")
        self.wait()
        writes_state = not replicated or self.rank == 0
        # A blocking save serializes before returning: the training loop cannot change the
        # state under it, so the copy would only cost time and memory.
        snapshot = None
        if writes_state:
            snapshot = state if blocking else _to_cpu(state, self._staging)
            self._staging = None if blocking else snapshot
        rng = capture_rng() if self._save_rng else None
        own = {"rng": rng, "state": None if replicated else snapshot}
        parts = [(part_name(self.rank), _writer(own))]
        if replicated and self.rank == 0:
            parts.append((REPLICATED, _writer(snapshot)))
        kind = "replicated" if replicated else "state"
        self.submit(step, parts, dict(metrics or {}), kind, blocking)

    def submit(
        self,
        step: int,
        parts: List[Tuple[str, Callable[[BinaryIO], object]]],
        metrics: Dict[str, float],
        kind: str,
        blocking: bool = False,
        cleanup: Callable[[], None] = lambda: None,
    ) -> None:
        """Write ``parts`` (name, writer into a stream) for ``step``, commit once every rank has;
        ``cleanup`` runs once the parts are written, whether or not that worked."""

        def job() -> None:
            try:
                written = [self._write_part(step, name, fill) for name, fill in parts]
            finally:
                cleanup()
            self._share_and_commit(step, written, metrics, kind)

        if blocking:
            try:
                job()
            except BaseException as err:
                self._failed = f"an earlier save failed ({err})"
                raise
            return
        self._thread = threading.Thread(
            target=self._run_in_background, args=(job,), name=f"ftlaunch-save-{step}"
        )
        self._thread.start()

    def own_rng_part(self) -> Tuple[str, Callable[[BinaryIO], object]]:
        """This rank's part when the state lives elsewhere (directory mode): its RNG states."""
        own = {"rng": capture_rng() if self._save_rng else None, "state": None}
        return part_name(self.rank), _writer(own)

    def wait(self) -> None:
        """Block until the save in flight is done; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            self._failed = f"an earlier save failed ({error})"
            raise CheckpointError(f"the previous checkpoint save failed: {error}") from error

    def barrier(self, name: str) -> None:
        """Return once every rank has called ``barrier(name)``."""
        self._channel.share(f"barrier/{name}", self.rank, "")
        self._channel.gather(f"barrier/{name}", self.world_size, self._commit_timeout)

    def _run_in_background(self, job) -> None:
        try:
            job()
        except BaseException as err:  # kept for the next call on the training thread
            log.error("background checkpoint save failed: %s", err)
            self._error = err

    def _share_and_commit(
        self, step: int, written: List[Dict[str, Any]], metrics: Dict[str, float], kind: str
    ) -> None:
        action = chaos_request(c.CHAOS_AT_COMMIT)
        if action is not None:
            act(action, f"after writing its part of step {step}, before the commit")
        self._channel.share(f"commit/{step}", self.rank, json.dumps(written))
        if self.rank == 0:
            gathered = self._channel.gather(f"commit/{step}", self.world_size, self._commit_timeout)
            self._commit(step, [p for value in gathered for p in json.loads(value)], metrics, kind)
            self._apply_retention(step)

    def _write_part(self, step: int, name: str, fill: Callable[[BinaryIO], object]) -> Dict[str, Any]:
        action = chaos_request(c.CHAOS_AT_SAVE)
        if action is not None:
            fill = dying_half_way(fill, action)
        size, sha256 = self.storage.write_stream(f"{step_dir(step)}/{name}", fill)
        return {"name": name, "size": size, "sha256": sha256}

    def _commit(self, step: int, parts: List[Dict[str, Any]], metrics: Dict[str, float], kind: str) -> None:
        names = [p["name"] for p in parts]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:  # two ranks wrote the same file: neither copy can be trusted to be "the" one
            raise CheckpointError(f"step {step} not committed: several ranks wrote {', '.join(clashes)}")
        marker = {
            "step": step,
            "world_size": self.world_size,
            "kind": kind,
            "parts": {p["name"]: {"size": p["size"], "sha256": p["sha256"]} for p in parts},
            "metrics": metrics,
            "time": time.time(),
        }
        self.storage.write_bytes(f"{step_dir(step)}/{MARKER}", json.dumps(marker, indent=1).encode())
        log.info("checkpoint step %d committed (%d parts)", step, len(parts))

    def _apply_retention(self, newest: int) -> None:
        """Rank 0 only: delete what the policy lets go, and uncommitted leftovers older than
        ``newest`` (crashed saves). Newer uncommitted steps may be a restarted run's next save."""
        committed = []
        for step, marker in self._markers():
            committed.append(CommittedStep(step, marker.get("metrics", {})))
        doomed = set(self._retention.to_delete(committed))
        doomed |= {s for s in self._steps() if s < newest and s not in {c.step for c in committed}}
        for step in sorted(doomed):
            self.storage.remove_tree(step_dir(step))
            log.info("checkpoint step %d deleted (retention)", step)

    def _wait_at_exit(self) -> None:
        try:
            self.wait()
        except CheckpointError as err:
            log.error("%s", err)

    # -- loading ----------------------------------------------------------------------------

    def load(self) -> Optional[Checkpoint]:
        """The newest step every rank can read and verify; None on a fresh run."""
        found = self.newest_agreed(self._read_state_parts)
        if found is None:
            return None
        step, marker, payload = found
        self.restore_rng(payload["own"])
        state = payload["replicated"] if marker.get("kind") == "replicated" else payload["own"]["state"]
        return Checkpoint(step=step, state=state, metrics=marker.get("metrics", {}))

    def newest_agreed(self, read: Callable[[int, Dict[str, Any]], Tuple[Any, Optional[str]]]):
        """(step, marker, payload) of the newest committed step that ``read`` accepts on every
        rank; the ranks agree through the channel, so all of them load the same step."""
        self.wait()
        self._loads += 1
        for round_, (step, marker) in enumerate(self._markers()):
            payload, problem = read(step, marker)
            key = f"load/{self._loads}/{round_}"
            self._channel.share(key, self.rank, f"{step}:{problem or 'ok'}")
            votes = self._channel.gather(key, self.world_size, self._commit_timeout)
            if all(v == f"{step}:ok" for v in votes):
                return step, marker, payload
            reasons = sorted({v.split(":", 1)[1] for v in votes if v != f"{step}:ok"})
            refused = [r for r in reasons if _REFUSED in r]
            if refused:  # every rank stops here: an older step would only hide the cause
                raise CheckpointError(f"checkpoint step {step}: {refused[0]}")
            log.warning(
                "checkpoint step %d is not usable (%s): falling back to the previous committed step",
                step,
                "; ".join(reasons),
            )
        return None

    def restore_rng(self, own_part: Dict[str, Any]) -> None:
        if own_part.get("rng") is not None and self._save_rng:
            restore_rng(own_part["rng"])

    def read_own_part(self, step: int, marker: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[str]]:
        name = part_name(self.rank)
        if marker.get("world_size") != self.world_size:
            if marker.get("kind") == "replicated":  # the state fits any world size; RNG streams do not
                return {"rng": None, "state": None}, None
            return {}, f"saved by {marker.get('world_size')} ranks, now {self.world_size}"
        data, problem = self.read_verified(step, name, marker["parts"].get(name))
        if problem:
            return {}, f"rank {self.rank}: {problem}"
        return self._deserialize(name, data)

    def _read_state_parts(self, step: int, marker: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[str]]:
        own, problem = self.read_own_part(step, marker)
        if problem or marker.get("kind") != "replicated":
            return {"own": own}, problem
        data, problem = self.read_verified(step, REPLICATED, marker["parts"].get(REPLICATED))
        if problem:
            return {}, f"rank {self.rank}: {problem}"
        state, problem = self._deserialize(REPLICATED, data)
        return ({}, problem) if problem else ({"own": own, "replicated": state}, None)

    def _deserialize(self, name: str, data: bytes) -> Tuple[Any, Optional[str]]:
        """The part's objects; a part that torch's weights-only loader refuses (an object outside
        its allow-list: a class of the script's, a numpy array, or a planted pickle) is a problem
        every rank stops at, with the way out."""
        import pickle

        import torch

        if self._trusted:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False), None
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), None
        except pickle.UnpicklingError as err:
            lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch 2.5+
            unsafe = lister(io.BytesIO(data)) if lister is not None else []
            return {}, (
                f"rank {self.rank}: {name} {_REFUSED} ({', '.join(unsafe) or str(err).splitlines()[0]}): "
                "allow them with torch.serialization.add_safe_globals([...]) before ft.init(), or, if "
                "only you can write this storage, ft.init(trusted_checkpoints=True)"
            )

    def read_verified(
        self, step: int, name: str, expected: Optional[Dict[str, Any]]
    ) -> Tuple[bytes, Optional[str]]:
        if expected is None:
            return b"", f"{name} is not listed in the commit marker"
        try:
            data = self.storage.read_bytes(f"{step_dir(step)}/{name}")
        except FileNotFoundError:
            return b"", f"{name} is missing"
        except StorageError as err:
            return b"", f"{name} cannot be read: {err}"
        if len(data) != expected["size"]:
            return b"", f"{name} has {len(data)} bytes, the marker says {expected['size']}"
        if hashlib.sha256(data).hexdigest() != expected["sha256"]:
            return b"", f"{name} fails its checksum"
        return data, None

    # -- listing ----------------------------------------------------------------------------

    def _steps(self) -> List[int]:
        return step_numbers(self.storage)

    def _markers(self) -> Iterator[Tuple[int, Dict[str, Any]]]:
        return committed_steps(self.storage)


def step_numbers(storage: Storage) -> List[int]:
    """Every step folder, committed or not, oldest first."""
    names = storage.list_names()
    return sorted(
        int(n[len(_STEP_PREFIX) :])
        for n in names
        if n.startswith(_STEP_PREFIX) and n[len(_STEP_PREFIX) :].isdigit()
    )


def committed_steps(storage: Storage) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """Committed steps, newest first, with their markers (the supervisor reads these too)."""
    for step in reversed(step_numbers(storage)):
        try:
            marker = json.loads(storage.read_bytes(f"{step_dir(step)}/{MARKER}"))
        except FileNotFoundError:
            continue  # not committed: does not exist for readers
        except (ValueError, StorageError) as err:
            log.warning("checkpoint step %d: unreadable commit marker (%s); skipped", step, err)
            continue
        if _is_marker(marker, step):
            yield step, marker
        else:  # damaged or foreign: as if the step had never been committed
            log.warning("checkpoint step %d: its commit marker is not one ftlaunch wrote; skipped", step)


def _is_marker(marker: Any, step: int) -> bool:
    """The shape ``_commit`` writes: the step, the world size, every part's size and checksum."""
    if not isinstance(marker, dict) or marker.get("step") != step:
        return False
    parts = marker.get("parts")
    return (
        isinstance(marker.get("world_size"), int)
        and isinstance(parts, dict)
        and all(isinstance(p, dict) and {"size", "sha256"} <= set(p) for p in parts.values())
        and isinstance(marker.get("time", 0.0), (int, float))
    )


def _to_cpu(state: Any, staging: Any = None) -> Any:
    """A copy the training loop cannot change under the background writer: tensors are copied
    to CPU memory, containers rebuilt, anything else deep-copied. ``staging``, an earlier result
    no longer in use, lends its tensors where shape and dtype match."""
    import copy

    import torch

    if isinstance(state, torch.Tensor):
        if (
            isinstance(staging, torch.Tensor)
            and staging.shape == state.shape
            and staging.dtype == state.dtype
            and staging.is_contiguous()
        ):
            return staging.copy_(state.detach())
        return state.detach().to("cpu", copy=True)
    if type(state) in (dict, collections.OrderedDict):  # a state_dict is an OrderedDict
        lend = staging if isinstance(staging, dict) else {}
        return type(state)((k, _to_cpu(v, lend.get(k))) for k, v in state.items())
    if type(state) in (list, tuple):
        lend = staging if type(staging) is type(state) and len(staging) == len(state) else [None] * len(state)
        return type(state)(_to_cpu(v, s) for v, s in zip(state, lend))
    return copy.deepcopy(state)


def _writer(payload: Any) -> Callable[[BinaryIO], object]:
    """Serialize straight into the storage stream (no in-memory copy of the whole part)."""
    import torch

    return lambda handle: torch.save(payload, handle)
