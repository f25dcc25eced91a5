"""Per-rank checkpoints: this rank's saves (a host copy now, written in the background) and loads,
over the staging set (``staging``), the marker (``marker``) and the ranks' agreement (``commit``).
"""

import atexit
import dataclasses
import logging
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Set, Tuple

from worker_lib.checkpoint.commit import (
    CheckpointError,
    CommitChannel,
    Commits,
    LocalChannel,
    StoreChannel,
)
from worker_lib.checkpoint.flat import on_cuda
from worker_lib.checkpoint.marker import (
    REPLICATED,
    CommitMarker,
    PartEntry,
    committed_steps,
    part_name,
)
from worker_lib.checkpoint.memory import MemorySnapshots
from worker_lib.checkpoint.parts import PartReader
from worker_lib.checkpoint.retention import RetentionPolicy
from worker_lib.checkpoint.staging import StagingArea, to_cpu
from worker_lib.checkpoint.writing import PartWriter
from worker_lib.core import contract as c
from worker_lib.core.rng import capture_rng, restore_rng
from worker_lib.core.storage import Storage

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CommitChannel",
    "LocalChannel",
    "StoreChannel",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    step: int
    state: Any
    metrics: Dict[str, float]


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
        memory: Optional[MemorySnapshots] = None,
    ) -> None:
        self.storage = storage
        self.memory = memory  # the node's memory tier (None: not under ftlaunch, or none there)
        self.loaded_tier = c.LOADED_NONE  # where the last load() found its step
        self.rank = rank
        self.world_size = world_size
        self._commits = Commits(
            storage, rank, world_size, channel, retention or RetentionPolicy(), commit_timeout
        )
        self._save_rng = save_rng
        self._parts = PartReader(storage, rank, world_size, trusted)
        # The previous async save's CPU copy, reused by the next (no new allocation to fault in).
        self._staging: Any = None
        # A CUDA state's copy: one pinned buffer, reused (DCP's staging too).
        self.pinned = StagingArea(rank)
        self._writer = PartWriter(storage, rank, self._commits)
        # Steps saved or loaded here: the same on every rank, so all skip a repeated save together.
        self._steps_in_storage: Set[int] = set()
        atexit.register(self._wait_at_exit)

    # -- saving -----------------------------------------------------------------------------

    def repeats(self, step: int) -> bool:
        """Whether a save of ``step`` repeats one saved or loaded here: skipped, since rewriting a
        committed step leaves it torn until its new marker lands."""
        if step not in self._steps_in_storage:
            return False
        log.warning(
            "checkpoint step %d is already in storage (saved or loaded by this process): not "
            "written again, so that it stays whole; a new step number saves a new checkpoint",
            step,
        )
        return True

    def snapshot(
        self, step: int, state: Any, metrics: Optional[Dict[str, float]] = None, kind: str = "parts"
    ) -> None:
        """Copy this rank's ``state`` (and its RNG states) into the node's memory tier, now."""
        if self.memory is None:
            raise CheckpointError(
                "to='memory' needs ftlaunch's node-local memory tier (FTLAUNCH_MEMORY_DIR), which "
                "this worker was not given: launch it with ftlaunch, or save to storage"
            )
        rng = capture_rng() if self._save_rng else None
        self.memory.save(step, {"state": state, "rng": rng}, dict(metrics or {}), kind)

    def save(
        self,
        step: int,
        state: Any,
        metrics: Optional[Dict[str, float]] = None,
        replicated: bool = False,
        blocking: bool = False,
    ) -> None:
        """Copy ``state`` to CPU memory now; write and commit it in the background (or now). After
        a failed save every later one raises at once (its parts could never be committed)."""
        if self._writer.failed:
            raise CheckpointError(f"rank {self.rank} saves no more checkpoints: {self._writer.failed}")
        if self.repeats(step):
            return
        self.wait()
        writes_state = not replicated or self.rank == 0
        snapshot, ready = self._copy(state, blocking) if writes_state else (None, _done)
        rng = capture_rng() if self._save_rng else None
        own = {"rng": rng, "state": None if replicated else snapshot}
        parts = [(part_name(self.rank), _writer(own))]
        if replicated and self.rank == 0:
            parts.append((REPLICATED, _writer(snapshot)))
        kind = "replicated" if replicated else "state"
        self.submit(step, parts, dict(metrics or {}), kind, blocking, ready=ready)

    def _copy(self, state: Any, blocking: bool) -> Tuple[Any, Callable[[], None]]:
        """(What the writer serializes, what it waits for first): a CUDA state via the pinned
        staging set; a CPU state in place when blocking, else into the previous save's copy."""
        if on_cuda(state):
            staged = self.pinned.stage(state)
            return staged.state, staged.wait
        snapshot = state if blocking else to_cpu(state, self._staging)
        self._staging = None if blocking else snapshot
        return snapshot, _done

    def submit(
        self,
        step: int,
        parts: List[Tuple[str, Callable[[BinaryIO], object]]],
        metrics: Dict[str, float],
        kind: str,
        blocking: bool = False,
        cleanup: Callable[[], None] = lambda: None,
        written_elsewhere: Callable[[], List[Tuple[str, PartEntry]]] = list,
        ready: Callable[[], None] = lambda: None,
    ) -> None:
        """Write ``parts`` (name, writer into a stream) for ``step`` and commit it once every rank
        has, in the background (or now): ``PartWriter.submit``."""
        self._steps_in_storage.add(step)
        self._writer.submit(step, parts, metrics, kind, blocking, cleanup, written_elsewhere, ready)

    def own_rng_part(self) -> Tuple[str, Callable[[BinaryIO], object]]:
        """This rank's part when the state lives elsewhere (directory mode): its RNG states."""
        own = {"rng": capture_rng() if self._save_rng else None, "state": None}
        return part_name(self.rank), _writer(own)

    def wait(self) -> None:
        """Block until the save in flight is done and retention has deleted what it let go;
        raise the save's error, if it failed."""
        self._writer.wait()

    def wait_all(self) -> None:
        """``wait``, and until the last memory snapshot's copy is done and its record written."""
        self.wait()
        if self.memory is not None:
            self.memory.flush()

    def barrier(self, name: str) -> None:
        """Return once every rank has called ``barrier(name)``."""
        self._commits.barrier(name)

    def _wait_at_exit(self) -> None:
        try:
            self.wait_all()
        except CheckpointError as err:
            log.error("%s", err)

    # -- loading ----------------------------------------------------------------------------

    def load(self) -> Optional[Checkpoint]:
        """The newest step every rank can read and verify, from the node's memory tier when every
        rank holds it there and it is at least as new as storage's; None on a fresh run."""
        self.wait()
        in_memory = self.load_from_memory("parts", lambda payload: payload["state"])
        if in_memory is not None:
            return in_memory
        found = self.newest_agreed(self._read_state_parts)
        self.loaded_tier = c.LOADED_NONE if found is None else c.LOADED_STORAGE
        if found is None:
            return None
        marker, payload = found
        self.restore_rng(payload["own"])
        state = payload["replicated"] if marker.kind == "replicated" else payload["own"]["state"]
        return Checkpoint(step=marker.step, state=state, metrics=marker.metrics)

    def load_from_memory(
        self, kind: str, take: Callable[[Any], Any], fresh: bool = True
    ) -> Optional[Checkpoint]:
        """The newest step of ``kind`` every rank holds in memory, or None (then storage);
        ``take(payload)`` makes its state. ``fresh``: as ``MemorySnapshots.read``."""
        if self.memory is None:
            return None
        stored = next(
            (
                m.step
                for m in committed_steps(self.storage)
                if m.loads_at(self.world_size) and (m.kind == "dcp") == (kind == "dcp")
            ),
            None,
        )
        step = self.memory.newest_agreed(stored, kind)
        if step is None:
            self.memory.forget()
            return None
        payload, problem = self.memory.read(step, fresh)
        state = None
        if problem is None:
            try:
                state = take(payload)
            except Exception as err:  # noqa: BLE001 - a state that does not fit: storage's turn
                problem = f"rank {self.rank}: memory step {step} does not fit this state: {err}"
        if not self.memory.agree_read(problem is None):
            log.warning(
                "memory step %d cannot be read on every rank (%s): loading from storage", step, problem
            )
            self.memory.forget()
            return None
        self.memory.adopt(step)
        if step == stored:  # committed in storage too: not to be written again
            self._steps_in_storage.add(step)
        self.restore_rng(payload)
        origin = self.memory.origin(step)
        self.loaded_tier = c.LOADED_PEER if origin else c.LOADED_MEMORY
        log.info(
            "checkpoint step %d loaded from the node's memory tier%s%s",
            step,
            f" ({origin})" if origin else "",
            " (its slot mapped ahead by this worker's warm spare)" if self.memory.read_ahead else "",
        )
        return Checkpoint(step=step, state=state, metrics=self.memory.metrics(step))

    def newest_agreed(self, read: Callable[[CommitMarker], Tuple[Any, Optional[str]]]):
        """(marker, payload) of the newest committed step that ``read`` accepts on every rank;
        the ranks agree through the channel, so all of them load the same step."""
        self.wait()
        found = self._commits.newest_agreed(read)
        if found is not None:
            self._steps_in_storage.add(found[0].step)
        return found

    def restore_rng(self, own_part: Dict[str, Any]) -> None:
        if own_part.get("rng") is not None and self._save_rng:
            restore_rng(own_part["rng"])

    def read_own_part(self, marker: CommitMarker) -> Tuple[Dict[str, Any], Optional[str]]:
        """This rank's own part of ``marker``'s step, read and verified, or its problem."""
        return self._parts.own(marker)

    def _read_state_parts(self, marker: CommitMarker) -> Tuple[Dict[str, Any], Optional[str]]:
        own, problem = self._parts.own(marker)
        if problem or marker.kind != "replicated":
            return {"own": own}, problem
        state, problem = self._parts.read(marker, REPLICATED)
        return ({}, problem) if problem else ({"own": own, "replicated": state}, None)


def _done() -> None:
    """Nothing to wait for: the copy was made on the caller's thread."""


def _writer(payload: Any) -> Callable[[BinaryIO], object]:
    """Serialize straight into the storage stream (no in-memory copy of the whole part)."""
    import torch

    return lambda handle: torch.save(payload, handle)
