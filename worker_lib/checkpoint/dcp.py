"""``format="dcp"``: torch.distributed.checkpoint (DCP) writes the step, ftlaunch commits it.

DCP writes each rank's shards into ``step_<n>/dcp/`` on any fsspec URL and loads at any world
size. ftlaunch adds, as for parts: the COMMITTED marker (every file's size and CRC32C, the
checksums shared among the ranks), the ranks' vote at the load with fall-back on damage, each
rank's RNG part, and the memory tier (a rank's own shards, same world size). ``async_save`` runs
its collectives on a gloo group of its own, so they never interleave with the loop's, and is
staged by ``PinnedStager`` into the manager's one reused buffer.
"""

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

from worker_lib.checkpoint.flat import split
from worker_lib.checkpoint.manager import Checkpoint, CheckpointError, CheckpointManager
from worker_lib.checkpoint.marker import CommitMarker, PartEntry, step_dir
from worker_lib.checkpoint.staging import StagingArea
from worker_lib.core import contract as c

__all__ = ["FOLDER", "PinnedStager", "load_dcp", "save_dcp", "snapshot_dcp"]

log = logging.getLogger(__name__)

FOLDER = "dcp"  # under step_<n>/
_group = None  # the gloo group DCP's collectives run on, made at the first save or load


def save_dcp(
    manager: CheckpointManager, step: int, state: Any, metrics: Dict[str, float], blocking: bool
) -> None:
    """Every rank calls it with its own (sharded) ``state``; returns once the state is staged
    (asynchronous) or written (``blocking``); the commit follows in the background."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    if manager.repeats(step):
        return
    manager.wait()
    folder = manager.storage.url_of(step_dir(step), FOLDER)
    writer = FsspecWriter(folder, **manager.storage.options)
    group, alone = _checkpoint_group()
    if blocking:
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=alone)
        done: Callable[[], object] = lambda: None  # noqa: E731
    else:
        stager = PinnedStager(manager.pinned)
        response = dcp.async_save(
            state, storage_writer=writer, process_group=group, no_dist=alone, async_stager=stager
        )
        # Older torch returns the upload's future; newer, an AsyncSaveResponse that holds it.
        done = (response if isinstance(response, Future) else response.upload_completion).result
    written = lambda: _share(manager, step, done)  # noqa: E731 - DCP's files, once it is done
    manager.submit(step, [manager.own_rng_part()], metrics, "dcp", blocking, written_elsewhere=written)


def _share(manager: CheckpointManager, step: int, done: Callable[[], object]) -> List[Tuple[str, PartEntry]]:
    """Once DCP is done on every rank: this rank's share of its files, checksummed."""
    done()
    names = sorted(manager.storage.list_names(f"{step_dir(step)}/{FOLDER}"))
    if ".metadata" not in names:
        raise CheckpointError(f"step {step}: torch.distributed.checkpoint wrote no .metadata (found {names})")
    mine = [f"{FOLDER}/{name}" for name in names[manager.rank :: manager.world_size]]
    return [(name, PartEntry(*manager.storage.checksum_of(f"{step_dir(step)}/{name}"))) for name in mine]


def snapshot_dcp(manager: CheckpointManager, step: int, state: Any, metrics: Dict[str, float]) -> None:
    """``to="memory"``: this rank's own shards of ``state`` into the node's memory tier."""
    manager.snapshot(step, _local_view(state), metrics, kind="dcp")


def load_dcp(manager: CheckpointManager, into: Any) -> Optional[Checkpoint]:
    """Load the newest committed DCP step that every rank verifies into ``into`` (the script's
    current, possibly sharded, state dict), in place, at any world size; None on a fresh run.
    A newer (or as new) step that every rank holds in the memory tier comes first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    manager.wait()
    # The snapshot's tensors are views of its slot, copied once, straight into ``into``'s shards.
    take = lambda payload: _copy_into(into, payload["state"])  # noqa: E731
    in_memory = manager.load_from_memory("dcp", take, fresh=False)
    if in_memory is not None:
        return in_memory
    found = manager.newest_agreed(lambda marker: _verify_share(manager, marker))
    manager.loaded_tier = c.LOADED_NONE if found is None else c.LOADED_STORAGE
    if found is None:
        return None
    marker, own = found
    group, alone = _checkpoint_group()
    reader = _reader(manager, marker.step)
    try:
        dcp.load(into, storage_reader=reader, process_group=group, no_dist=alone)
    except CheckpointException as err:  # a BaseException, carrying every rank's failure
        causes = "; ".join(sorted({str(failure[0]) for failure in err.failures.values()}))
        raise CheckpointError(
            f"checkpoint step {marker.step} does not load into this state: {causes}"
        ) from None
    manager.restore_rng(own)
    return Checkpoint(step=marker.step, state=into, metrics=marker.metrics)


def _reader(manager: CheckpointManager, step: int):
    """DCP's reader for ``step``: a local folder through a mapping (``dcp_reader``), any other
    storage through DCP's fsspec reader."""
    if manager.storage.is_local:
        from worker_lib.checkpoint.dcp_reader import MappedReader

        return MappedReader(manager.storage.path(step_dir(step), FOLDER))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(manager.storage.url_of(step_dir(step), FOLDER), **manager.storage.options)


def _verify_share(manager: CheckpointManager, marker: CommitMarker) -> Tuple[Dict[str, Any], Optional[str]]:
    """This rank's vote on a step: its RNG part (at the same world size) and its share of the
    DCP files, read and checked against the marker."""
    if marker.kind != "dcp":
        return {}, f"step {marker.step} was not saved with format='dcp'"
    own, problem = manager.read_own_part(marker)
    if problem:
        return {}, problem
    names = sorted(n for n in marker.parts if n.startswith(f"{FOLDER}/"))
    for name in names[manager.rank :: manager.world_size]:
        expected = marker.parts[name]
        try:
            size, found = manager.storage.checksum_of(f"{step_dir(marker.step)}/{name}", expected.algorithm)
        except FileNotFoundError:
            return {}, f"rank {manager.rank}: {name} is missing"
        except Exception as err:  # noqa: BLE001 - storage errors of any backend: a vote against
            return {}, f"rank {manager.rank}: {name} cannot be read: {err}"
        if size != expected.size:
            return {}, f"rank {manager.rank}: {name} has {size} bytes, the marker says {expected.size}"
        if found != expected.checksum:
            return {}, f"rank {manager.rank}: {name} fails its checksum"
    return own, None


def _local_view(value: Any) -> Any:
    """``value`` with each DTensor replaced by this rank's shard and each ``Stateful`` by its
    state dict: what this rank alone holds, for its memory snapshot."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: _local_view(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local_view(v) for v in value)
    if _stateful(value):
        return _local_view(value.state_dict())
    return value


def _copy_into(target: Any, saved: Any) -> Any:
    """``saved`` (a ``_local_view``) copied into ``target`` in place, shard by shard; the value
    ``target`` holds afterwards. A key or a shape that differs is an error (ValueError)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(target, (DTensor, torch.Tensor)):
        local = target.to_local() if isinstance(target, DTensor) else target
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            raise ValueError(
                f"a shard of shape {tuple(local.shape)} was saved as {getattr(saved, 'shape', saved)}"
            )
        with torch.no_grad():
            local.copy_(saved)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict) or set(saved) != set(target):
            raise ValueError(f"the keys differ: {sorted(map(str, target))} here")
        for key in target:
            target[key] = _copy_into(target[key], saved[key])
        return target
    if isinstance(target, list) and isinstance(saved, list) and len(saved) == len(target):
        target[:] = [_copy_into(t, s) for t, s in zip(target, saved)]
        return target
    if _stateful(target):
        target.load_state_dict(_copy_into(target.state_dict(), saved))
        return target
    return saved.clone() if isinstance(saved, torch.Tensor) else saved  # not a view of the slot


class PinnedStager:
    """DCP's ``AsyncStager``: the state copied into ``area``'s buffer, each DTensor as its local
    shard, rewrapped; DCP's writer gets it through a future completed after the copies' events,
    so the loop only enqueues them."""

    # AsyncStager's protocol lists the flag its own property reads; this class answers with its own.
    _synchronize_after_execute: bool = False

    def __init__(self, area: StagingArea) -> None:
        self._area = area

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # the future is the synchronization

    def stage(self, state_dict: Any) -> Future:
        staged = self._area.stage_split(split(state_dict, copy_objects=True, dtensors=True))
        future: Future = Future()

        def finish() -> None:
            try:
                staged.wait()
                future.set_result(staged.state)
            except BaseException as err:  # noqa: BLE001 - DCP's writer raises it
                future.set_exception(err)

        threading.Thread(target=finish, name="ftlaunch-dcp-staging", daemon=True).start()
        return future

    def synchronize_staging(self) -> None:
        """Nothing: DCP's writer waits on the future ``stage`` returned."""

    def close(self) -> None:
        """Nothing: the buffer is the manager's, reused by its next save."""


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _checkpoint_group():
    """(DCP's process group, whether this rank is alone): a gloo group of its own, made by every
    rank at its first DCP save or load."""
    global _group
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, True
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group, False
