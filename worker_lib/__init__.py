"""What training scripts import: ``import worker_lib as ft``.

    ft.init()                                       # process group from the environment
    ckpt = ft.load_checkpoint()                     # None on a fresh run; else .step .state .metrics
    ft.save_checkpoint(step, state, metrics=None)   # every rank; copied now, written in background
    ft.save_checkpoint(step, state, format="dcp")   # sharded (torch.distributed.checkpoint)...
    ft.load_checkpoint(into=state)                  # ...loaded in place at any world size
    ft.heartbeat(step)                              # every step: progress, for hang detection
    if ft.should_stop(step): save, then break       # Ctrl+C or a preemption: same step on all ranks
    ft.shutdown()                                   # last: waits for the save, leaves the group

Importing this package is cheap (no torch): workers that only read their environment pay nothing.
"""

import contextlib
import time
from typing import Any, Dict, Optional

from worker_lib.checkpoint.retention import RetentionPolicy
from worker_lib.core import contract
from worker_lib.core.backend import choose_backend
from worker_lib.core.progress import (
    count_save,
    heartbeat,
    mark_loaded,
    pause_heartbeat,
    should_stop,
    stop_beating,
)

__all__ = [
    "contract",
    "choose_backend",
    "init",
    "info",
    "heartbeat",
    "pause_heartbeat",
    "should_stop",
    "save_checkpoint",
    "load_checkpoint",
    "wait_for_checkpoint",
    "checkpoint_dir",
    "latest_checkpoint_dir",
    "newest_checkpoint_dir",
    "is_initialized",
    "shutdown",
]

_session = None


def init(
    checkpoint_dir: Optional[str] = None,
    *,
    keep_last: int = 2,
    keep_best: int = 0,
    best_metric: Optional[str] = None,
    best_mode: str = "min",
    save_rng: bool = True,
    init_process_group: bool = True,
    storage_options: Optional[Dict[str, Any]] = None,
    trusted_checkpoints: bool = False,
):
    """Join the process group and open checkpoint storage; call once, early, on every rank.
    Storage that cannot be written raises ``StorageError`` here, before training starts.

    Args:
        checkpoint_dir: any fsspec URL; default: ftlaunch's ``--checkpoint-dir``.
        trusted_checkpoints: unpickle anything, running whatever code a part holds (only for
            storage no one else can write). Default: torch's weights-only loader.
    """
    from worker_lib.session import CheckpointOptions, start_session

    global _session
    options = CheckpointOptions(
        RetentionPolicy(keep_last, keep_best, best_metric, best_mode),
        save_rng,
        storage_options or {},
        trusted_checkpoints,
    )
    with pause_heartbeat():  # joining the group waits for the slowest rank to start
        _session = start_session(checkpoint_dir, init_process_group, options)
    return _session.info


def info():
    """This process's WorkerInfo (rank, world size, attempt, ...)."""
    return _require_session().info


def save_checkpoint(
    step: int,
    state: Any,
    metrics: Optional[Dict[str, float]] = None,
    *,
    replicated: bool = False,
    blocking: bool = False,
    format: str = "parts",
    to: str = "storage",
) -> None:
    """Save this rank's ``state`` for ``step``; every rank calls it. The state is copied before
    this returns (a GPU state's copy enqueued on the current stream); writing and the commit
    follow in the background. A step already saved or loaded is never written again.

    Args:
        replicated: the state is the same on every rank (plain DDP): rank 0 writes it once and
            it loads at any world size. Else each rank's own part, at the same world size.
        blocking: write and commit before returning; else the next save waits for this one
            and raises its failure.
        format: ``"dcp"``: torch.distributed.checkpoint's shards, which
            ``load_checkpoint(into=...)`` reshards at any world size.
        to: ``"memory"``: a snapshot into the node's memory tier (/dev/shm), which survives a
            crash and a restart but not the node; cheap enough for every step.
    """
    if format not in ("parts", "dcp"):
        raise ValueError(f"format must be 'parts' or 'dcp', not {format!r}")
    if to not in ("storage", "memory"):
        raise ValueError(f"to must be 'storage' or 'memory', not {to!r}")
    if format == "dcp" and replicated:
        raise ValueError("format='dcp' saves each rank's shards: replicated=True does not apply")
    started = time.monotonic_ns()
    with pause_heartbeat():  # waiting for the previous save, or a blocking save, is not a hang
        if to == "memory" and format == "dcp":
            from worker_lib.checkpoint.dcp import snapshot_dcp

            snapshot_dcp(_checkpoints(), step, state, dict(metrics or {}))
        elif to == "memory":
            _checkpoints().snapshot(step, state, metrics)
        elif format == "dcp":
            from worker_lib.checkpoint.dcp import save_dcp

            save_dcp(_checkpoints(), step, state, dict(metrics or {}), blocking)
        else:
            _checkpoints().save(step, state, metrics, replicated=replicated, blocking=blocking)
    count_save(to == "memory", time.monotonic_ns() - started)


def load_checkpoint(into: Any = None):
    """The newest checkpoint every rank committed and can verify, or None on a fresh run; a CUDA
    tensor comes back onto this rank's current GPU.

    Args:
        into: the script's current state dict: the newest ``format="dcp"`` step is loaded into
            it in place, resharded to this world size (the record's ``.state``)."""
    started = time.monotonic_ns()
    with pause_heartbeat():
        if into is not None:
            from worker_lib.checkpoint.dcp import load_dcp

            found = load_dcp(_checkpoints(), into)
        else:
            found = _checkpoints().load()
    took = time.monotonic_ns() - started
    mark_loaded(found.step if found is not None else None, _checkpoints().loaded_tier, took)
    return found


def checkpoint_dir(step: int, metrics: Optional[Dict[str, float]] = None):
    """``with ft.checkpoint_dir(step) as d:`` write any files into the local directory ``d``,
    committed as ``step`` in the background on leaving; every rank enters it."""
    from worker_lib.checkpoint.directory import save_directory

    return _paused(save_directory(_checkpoints(), step, metrics))


def latest_checkpoint_dir() -> Optional[str]:
    """A local directory with the newest committed directory-mode step, or None on a fresh run."""
    found = newest_checkpoint_dir()
    return None if found is None else found.path


def newest_checkpoint_dir():
    """As ``latest_checkpoint_dir``, a ``CommittedDir`` (``.step``, ``.path``); every rank calls it."""
    from worker_lib.checkpoint.directory import latest_directory

    session = _require_session()
    started = time.monotonic_ns()
    with pause_heartbeat():
        found = latest_directory(_checkpoints(), session.info.run_id, session.info.attempt)
    took = time.monotonic_ns() - started
    mark_loaded(found.step if found is not None else None, contract.LOADED_STORAGE, took)
    return found


def is_initialized() -> bool:
    """Whether ``init`` was called in this process (and ``shutdown`` not yet)."""
    return _session is not None


def wait_for_checkpoint() -> None:
    """Block until the save in flight is committed and the last memory snapshot held; raises
    either's error."""
    with pause_heartbeat():
        _checkpoints().wait_all()


def shutdown() -> None:
    """Call once at the end, on every rank: waits for the save in flight and every rank, removes
    fetched copies and destroys the process group; raises if the last save failed."""
    global _session
    stop_beating()  # the last save, the barrier and the interpreter's exit are not steps
    if _session is not None:
        session, _session = _session, None
        session.close()


@contextlib.contextmanager
def _paused(block):
    """``block`` (a directory-mode save) with the heartbeat paused, counted as a save."""
    started = time.monotonic_ns()
    with pause_heartbeat(), block as value:
        yield value
    count_save(False, time.monotonic_ns() - started)


def _require_session():
    if _session is None:
        raise RuntimeError("call worker_lib.init() first")
    return _session


def _checkpoints():
    manager = _require_session().checkpoints
    if manager is None:
        raise RuntimeError(
            "no checkpoint storage: run under `ftlaunch --checkpoint-dir URL` or call "
            "worker_lib.init(checkpoint_dir=URL)"
        )
    return manager
