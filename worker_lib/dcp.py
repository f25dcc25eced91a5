"""``format="dcp"``: torch.distributed.checkpoint (DCP) writes the step, ftlaunch commits it.

DCP saves only each rank's shards of a state dict (DTensors, sharded tensors, ``Stateful``
objects), into ``step_<n>/dcp/`` on any fsspec URL (its ``FsspecWriter``), and at the load reads
only the chunks each rank needs: a step saved by N ranks loads at any world size. What ftlaunch
adds on top:

- **The commit.** Once DCP is done on every rank (its ``.metadata`` is written last, by rank 0),
  the files are checksummed, each rank a share of them, and rank 0 writes the COMMITTED marker
  listing every file with its size and CRC32C, as for parts (where the object store keeps a
  CRC32C of every object, GCS, it is taken from there: nothing is read back). A step without it
  is never loaded.
- **The vote.** At the load every rank verifies its share of the newest committed step's files;
  the ranks agree through the job's store and fall back step by step on damage, as for parts.
- **Asynchronous by default.** ``dcp.async_save`` copies the state to CPU memory on the caller's
  thread and writes in the background; its collectives run on a gloo group of their own, so they
  never interleave with the training loop's.
- Each rank's RNG streams go beside it (``rank_<r>.pt``), restored at the same world size.
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from worker_lib.checkpoint import Checkpoint, CheckpointError, CheckpointManager
from worker_lib.marker import CommitMarker, PartEntry, step_dir

__all__ = ["FOLDER", "save_dcp", "load_dcp"]

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

    manager.wait()
    folder = manager.storage.url_of(step_dir(step), FOLDER)
    writer = FsspecWriter(folder, **manager.storage.options)
    group, alone = _checkpoint_group()
    if blocking:
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=alone)
        done: Callable[[], object] = lambda: None  # noqa: E731
    else:
        future = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=alone)
        done = getattr(future, "upload_completion", future).result
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


def load_dcp(manager: CheckpointManager, into: Any) -> Optional[Checkpoint]:
    """Load the newest committed DCP step that every rank verifies into ``into`` (the script's
    current, possibly sharded, state dict), in place, at any world size; None on a fresh run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.api import CheckpointException

    found = manager.newest_agreed(lambda marker: _verify_share(manager, marker))
    if found is None:
        return None
    marker, own = found
    group, alone = _checkpoint_group()
    folder = manager.storage.url_of(step_dir(marker.step), FOLDER)
    reader = FsspecReader(folder, **manager.storage.options)
    try:
        dcp.load(into, storage_reader=reader, process_group=group, no_dist=alone)
    except CheckpointException as err:  # a BaseException, carrying every rank's failure
        causes = "; ".join(sorted({str(failure[0]) for failure in err.failures.values()}))
        raise CheckpointError(
            f"checkpoint step {marker.step} does not load into this state: {causes}"
        ) from None
    manager.restore_rng(own)
    return Checkpoint(step=marker.step, state=into, metrics=marker.metrics)


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


def _checkpoint_group():
    """(The process group DCP's collectives run on, whether this rank is alone): a gloo group of
    its own, made once by every rank at its first DCP save or load (a collective call)."""
    global _group
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, True
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group, False
