"""``worker_lib.init()`` and the per-process session the module-level API works on."""

import dataclasses
import logging
import os
from typing import Any, Dict, Optional

from worker_lib.checkpoint.retention import RetentionPolicy
from worker_lib.core import contract as c
from worker_lib.core.backend import choose_backend

__all__ = ["CheckpointOptions", "WorkerInfo", "Session", "start_session"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Who this process is, read once from the environment torchrun or ftlaunch set."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    attempt: int
    run_id: str
    backend: str

    @classmethod
    def from_environ(cls, environ=os.environ) -> "WorkerInfo":
        gpus = _gpu_count()
        return cls(
            rank=int(environ.get(c.RANK, 0)),
            local_rank=int(environ.get(c.LOCAL_RANK, 0)),
            world_size=int(environ.get(c.WORLD_SIZE, 1)),
            local_world_size=int(environ.get(c.LOCAL_WORLD_SIZE, 1)),
            attempt=int(environ.get(c.RESTART_COUNT, 0)),
            run_id=environ.get(c.RUN_ID, "local"),
            backend=environ.get(c.FT_BACKEND) or choose_backend("auto", gpus),
        )

    @property
    def device(self) -> str:
        """This rank's device for ``torch.device()``: its GPU under nccl, else the CPU."""
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else "cpu"


@dataclasses.dataclass
class Session:
    info: WorkerInfo
    checkpoints: Optional[Any]  # CheckpointManager, or None without a checkpoint dir

    def close(self) -> None:
        """The save in flight committed, a barrier, then the fetched copies go (local rank 0's) and
        the group is destroyed. The barrier first: a slower rank may still read the cache, and
        gloo aborts at exit when a rank leaves a peer in its last collective (torch 2.13)."""
        if self.checkpoints is not None:
            self.checkpoints.wait()
        _barrier(self)
        if self.checkpoints is not None and self.info.local_rank == 0:
            _remove_node_cache(self.info, keep_attempt=None)
        dist = _initialized_torch_distributed()
        if dist is not None:
            dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How this process saves and loads checkpoints (``worker_lib.init``'s keyword arguments)."""

    retention: RetentionPolicy
    save_rng: bool = True
    storage_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    trusted: bool = False  # unpickle anything (else torch's weights-only loader)


def start_session(
    checkpoint_dir: Optional[str], init_process_group: bool, options: CheckpointOptions
) -> Session:
    info = WorkerInfo.from_environ()
    if init_process_group:  # one rank is a group too, as under torchrun --nproc-per-node 1
        _init_process_group(info)
    url = checkpoint_dir or os.environ.get(c.FT_CHECKPOINT_URL)
    manager = _checkpoint_manager(info, url, options) if url else None
    if manager is not None and info.local_rank == 0:
        _remove_node_cache(info, keep_attempt=info.attempt)
    return Session(info, manager)


def _remove_node_cache(info: WorkerInfo, keep_attempt: Optional[int]) -> None:
    """Local rank 0 owns this node's cache of fetched checkpoint files. At start, copies left by
    earlier attempts (which crashed, so never reached ``close``) go; at ``close``, all of it."""
    import shutil

    from worker_lib.checkpoint.directory import node_cache_root

    root = node_cache_root(info.run_id)
    doomed = [old for old in root.glob("attempt_*") if old.name != f"attempt_{keep_attempt}"]
    for folder in doomed + ([root] if keep_attempt is None and root.exists() else []):
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError as err:  # said, not hidden: a copy left behind takes the node's disk
            log.warning("could not remove the node's checkpoint copies %s: %s", folder, err)


def _barrier(session: Session) -> None:
    """Every rank of the job arrives: through the process group when there is one, else
    through the checkpoint channel (the job store)."""
    dist = _initialized_torch_distributed()
    if dist is not None:
        dist.barrier()
    elif session.checkpoints is not None:
        session.checkpoints.barrier("close")


def _initialized_torch_distributed():
    """torch.distributed if this process initialized a group; never imports torch itself."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _init_process_group(info: WorkerInfo) -> None:
    """env:// init, with the backend the supervisor chose; nccl binds this rank's GPU first."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # Under a launcher the group comes from the environment (env://); a script started with plain
    # `python` is a group of one, on a store of its own.
    launched = c.MASTER_ADDR in os.environ or info.world_size > 1
    alone: Dict[str, Any] = {} if launched else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    if info.backend == "nccl":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **alone)
    else:
        dist.init_process_group(info.backend, **alone)


def _checkpoint_manager(info: WorkerInfo, url: str, options: CheckpointOptions):
    from worker_lib.checkpoint.commit import CommitChannel
    from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel, StoreChannel
    from worker_lib.core.storage import Storage

    storage = Storage(url, **options.storage_options)
    storage.check_writable(f"rank{info.rank}")
    channel: CommitChannel
    if info.world_size == 1:
        channel = LocalChannel()
    else:
        channel = StoreChannel(_job_store(), prefix=f"ftlaunch/{info.run_id}/{info.attempt}/")
    return CheckpointManager(
        storage,
        info.rank,
        info.world_size,
        channel,
        options.retention,
        options.save_rng,
        trusted=options.trusted,
        memory=_memory_snapshots(info),
    )


def _memory_snapshots(info: WorkerInfo):
    """This rank's side of the node's memory tier, when ftlaunch gave one. Its votes go through
    a store client of their own: the storage saves' background thread may hold the other one
    for as long as a slow upload takes."""
    from worker_lib.checkpoint.manager import LocalChannel, StoreChannel
    from worker_lib.checkpoint.memory import MemorySnapshots, memory_folder

    folder = memory_folder()
    if folder is None:
        return None
    prefix = f"ftlaunch/{info.run_id}/{info.attempt}/memory/"
    if info.world_size == 1:
        return MemorySnapshots(folder, info.rank, info.world_size, LocalChannel())
    return MemorySnapshots(folder, info.rank, info.world_size, lambda: StoreChannel(_job_store(), prefix))


def _job_store():
    """A client of the store the launcher hosts (torchrun and ftlaunch both set
    TORCHELASTIC_USE_AGENT_STORE); else the default process group's own store."""
    from datetime import timedelta

    import torch.distributed as dist

    if os.environ.get(c.USE_AGENT_STORE) == "True":
        host, port = os.environ[c.MASTER_ADDR], int(os.environ[c.MASTER_PORT])
        return dist.TCPStore(host, port, None, False, timedelta(minutes=30))
    if not dist.is_initialized():
        raise RuntimeError(
            "worker_lib.init(): with several ranks and no launcher store, initialize the process group first"
        )
    return dist.distributed_c10d._get_default_store()
