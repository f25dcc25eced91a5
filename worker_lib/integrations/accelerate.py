"""Accelerate under ftlaunch: ``save_state``, ``load_state`` and ``after_step``.

    from worker_lib.integrations import accelerate as fault_tolerance

    info = worker_lib.init(init_process_group=False)          # ftlaunch's checkpoints and choice
    accelerator = Accelerator(cpu=info.device == "cpu")      # its GPU under NCCL, else the CPU
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = fault_tolerance.load_state(accelerator) or 0
    for batch in accelerator.skip_first_batches(loader, step % len(loader)): ...
        ...; optimizer.step(); step += 1
        stop = fault_tolerance.after_step(step)
        if stop or step % 50 == 0:
            fault_tolerance.save_state(accelerator, step)
        if stop:
            break
    worker_lib.shutdown()

Each rank's share of ``accelerator.save_state`` is committed as one step on any fsspec URL, and
``load_state`` loads the newest step every rank committed, never a torn one. The data position is
the script's (``skip_first_batches``; exact with a loader generator of its own). docs/frameworks.md
says what the adapter adds and checks.
"""

import re
from typing import Dict, Optional

import worker_lib as ft
from worker_lib.integrations._common import check_placement, join, keep_own_files

__all__ = ["save_state", "load_state", "after_step"]

# Accelerate's per-rank file; the others are written by the main process, or by every process
# alike (a GradScaler's state, a stateful loader's): rank 0's copy is the one kept.
_PER_RANK = re.compile(r"random_states_(\d+)\.pkl")
_FIX = "pass Accelerator(cpu=worker_lib.info().device == 'cpu') (examples/accelerate_train.py)"


def save_state(accelerator, step: int, metrics: Optional[Dict[str, float]] = None, **kwargs) -> None:
    """Save ``accelerator``'s state as ``step`` (every rank calls it); ``kwargs`` go to
    ``accelerator.save_state``. Written now, uploaded and committed in the background."""
    join(None)
    check_placement("Accelerate", accelerator.num_processes, accelerator.device, _FIX)
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError(
            "save_state writes into ftlaunch's step folder: turn ProjectConfiguration's "
            "automatic_checkpoint_naming off (the steps are numbered, committed and kept by ftlaunch)"
        )
    with ft.checkpoint_dir(step, metrics) as folder:
        accelerator.save_state(folder, **kwargs)
        keep_own_files(folder, accelerator.process_index, _PER_RANK)


def load_state(accelerator, **kwargs) -> Optional[int]:
    """Load the newest committed step into ``accelerator`` (every rank calls it) and return its
    number; None on a fresh run. ``kwargs`` go to ``accelerator.load_state``."""
    join(None)
    check_placement("Accelerate", accelerator.num_processes, accelerator.device, _FIX)
    found = ft.newest_checkpoint_dir()
    if found is None:
        return None
    accelerator.load_state(found.path, **kwargs)
    return found.step


def after_step(step: int) -> bool:
    """Call after each optimizer step: it beats (hang detection), and True means ftlaunch was
    asked to stop (Ctrl+C, a preemption) and every rank is at the step to save and leave at."""
    ft.heartbeat(step)
    return ft.should_stop(step)
