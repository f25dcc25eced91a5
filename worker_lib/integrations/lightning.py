"""PyTorch Lightning under ftlaunch: ``FaultTolerance``, a ``Callback``.

    from worker_lib.integrations.lightning import FaultTolerance

    fault_tolerance = FaultTolerance(every_n_steps=50)      # opens ftlaunch's checkpoints
    accelerator = torch.device(worker_lib.info().device).type  # "cuda" under NCCL, else "cpu"
    trainer = Trainer(accelerator=accelerator, devices=..., strategy="ddp", callbacks=[fault_tolerance])
    trainer.fit(model, data, ckpt_path=fault_tolerance.ckpt_path())
    worker_lib.shutdown()

Every ``every_n_steps`` optimizer steps (and at a preemption, one step agreed by every rank)
the ranks save with ``trainer.save_checkpoint``, committed once all are through; ``ckpt_path()``
names the newest committed file, never a torn one. Built on whichever of ``lightning.pytorch`` and
``pytorch_lightning`` the script imported first. Exact resume at epoch ends only:
docs/frameworks.md.
"""

import os
import sys
from typing import Optional

import worker_lib as ft
from worker_lib.integrations._common import BeatPause, check_placement, finite_metrics, join

__all__ = ["FaultTolerance", "FILENAME"]

FILENAME = "lightning.ckpt"  # in each committed step's folder
_FIX = (
    "give the Trainer accelerator=torch.device(worker_lib.info().device).type, devices=LOCAL_WORLD_SIZE "
    "and num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE (examples/lightning_train.py)"
)


def _callback_base():
    for package in ("lightning.pytorch", "pytorch_lightning"):
        if package in sys.modules:
            return sys.modules[package].Callback
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl.Callback


# The base is the Callback of the Lightning package the script imported: known only at import.
class FaultTolerance(_callback_base()):  # type: ignore[misc]
    """Saves every ``every_n_steps`` optimizer steps and at a preemption; ``checkpoint_dir`` and
    the keyword ``options`` are ``worker_lib.init``'s (default: ftlaunch's --checkpoint-dir)."""

    def __init__(self, every_n_steps: int = 100, checkpoint_dir: Optional[str] = None, **options) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                f"every_n_steps must be a whole number of steps, 1 or more, not {every_n_steps!r}"
            )
        super().__init__()
        self.every_n_steps = every_n_steps
        self._saved = -1  # the step saved last (a step is saved once)
        self.resumed_from: Optional[int] = None  # the step ckpt_path() found
        self._pause = BeatPause()
        join(checkpoint_dir, **options)

    def ckpt_path(self) -> Optional[str]:
        """The newest committed step's checkpoint file, for ``trainer.fit(ckpt_path=...)``; None
        on a fresh run. Every rank calls it: the ranks agree on the step."""
        found = ft.newest_checkpoint_dir()
        if found is None:
            return None
        path = os.path.join(found.path, FILENAME)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"checkpoint step {found.step} holds no {FILENAME}: it was not saved by "
                "FaultTolerance (another script saved into this --checkpoint-dir?)"
            )
        self._saved = self.resumed_from = found.step
        return path

    # -- Lightning's hooks -------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        check_placement("Lightning", trainer.world_size, trainer.strategy.root_device, _FIX)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # optimizer steps: the count a resume continues
        ft.heartbeat(step)
        if ft.should_stop(step):  # a preemption: this step on every rank
            self._save(trainer, step)
            trainer.should_stop = True
        elif step % self.every_n_steps == 0:
            self._save(trainer, step)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._pause.begin()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._pause.end()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._pause.end()
        ft.wait_for_checkpoint()  # the last save is committed before fit returns

    def _save(self, trainer, step: int) -> None:
        if step == self._saved or step == 0:
            return
        self._saved = step
        with ft.checkpoint_dir(step, finite_metrics(trainer.callback_metrics)) as folder:
            trainer.save_checkpoint(os.path.join(folder, FILENAME), weights_only=False)  # rank 0 writes
