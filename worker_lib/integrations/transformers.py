"""The Hugging Face Trainer under ftlaunch: ``FaultTolerance``, a ``TrainerCallback``.

    from worker_lib.integrations.transformers import FaultTolerance

    fault_tolerance = FaultTolerance()
    trainer = Trainer(model, args, train_dataset=..., callbacks=[fault_tolerance])
    trainer.train(resume_from_checkpoint=fault_tolerance.resume_from())
    worker_lib.shutdown()

Each ``checkpoint-<step>`` the Trainer writes (its ``save_steps``) is committed as an ftlaunch
step on any fsspec URL; ``resume_from()`` names a local folder with the newest step every rank
committed, never a torn one. A preemption saves one step agreed by every rank, so
``enable_jit_checkpoint`` is refused. docs/frameworks.md says what the adapter adds and checks.
"""

import os
import re
from typing import Optional

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import worker_lib as ft
from worker_lib.integrations._common import BeatPause, check_placement, commit_folder, finite_metrics, join

__all__ = ["FaultTolerance"]

# The Trainer's per-rank file (``rng_state.pth`` on a single rank, shared then).
_PER_RANK = re.compile(r"rng_state_(\d+)\.pth")
_FIX = (
    "give TrainingArguments use_cpu=worker_lib.info().device == 'cpu' and "
    "ddp_backend=worker_lib.info().backend (examples/transformers_train.py)"
)


class FaultTolerance(TrainerCallback):
    """``checkpoint_dir`` and the keyword ``options`` are ``worker_lib.init``'s (default: ftlaunch's
    --checkpoint-dir)."""

    def __init__(self, checkpoint_dir: Optional[str] = None, **options) -> None:
        join(checkpoint_dir, **options)
        self._pause = BeatPause()

    def resume_from(self) -> Optional[str]:
        """The newest committed checkpoint folder, for ``trainer.train(resume_from_checkpoint=...)``;
        None on a fresh run. Every rank calls it: the ranks agree on the step."""
        found = ft.newest_checkpoint_dir()
        return None if found is None else found.path

    # -- the Trainer's events ----------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        if getattr(args, "enable_jit_checkpoint", False):
            raise ValueError(
                "enable_jit_checkpoint saves on a timer per rank at SIGTERM; under ftlaunch every "
                "rank saves one agreed step instead: leave enable_jit_checkpoint off"
            )

    def on_train_begin(self, args, state, control, **kwargs):
        check_placement("The Trainer", args.world_size, args.device, _FIX)

    def on_step_begin(self, args, state, control, **kwargs):
        self._pause.end()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        ft.heartbeat(step)
        if ft.should_stop(step):  # a preemption: this step on every rank, then the end
            control.should_save = True
            control.should_training_stop = True
        if control.should_save or control.should_evaluate:
            self._pause.begin()  # the Trainer evaluates and saves next: not steps

    def on_save(self, args, state, control, **kwargs):
        step = state.global_step
        source = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        metrics = finite_metrics(state.log_history[-1]) if state.log_history else {}
        commit_folder(step, source, args.process_index, _PER_RANK, metrics)
        self._pause.end()

    def on_train_end(self, args, state, control, **kwargs):
        self._pause.end()
        ft.wait_for_checkpoint()  # the last save is committed before train returns
