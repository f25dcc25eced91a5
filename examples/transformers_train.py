"""Train a one-layer GPT-2 with the Hugging Face Trainer (DDP) under ftlaunch, and survive crashes
and preemptions with the ``FaultTolerance`` callback.

    ftlaunch --nproc 2 --checkpoint-dir runs/gpt2 examples/transformers_train.py --max-steps 200

What the callback adds to the Trainer: each of its saves (``save_steps``) becomes an ftlaunch step,
committed once every rank wrote its share, on any fsspec URL (the Trainer alone writes local
folders); ``resume_from()`` never names a torn folder, which ``get_last_checkpoint`` may; each
step beats (a stuck collective is found and the group restarted); a preemption makes every rank
save one agreed step and stop. The Trainer's own resume is exact (weights, optimizer, scheduler,
each rank's RNG streams, the batches already seen), so a run with a crash ends where an
uninterrupted one would. The model is built from a ``GPT2Config`` and the data are random tokens:
nothing is downloaded. ``--step-time`` slows each step down, to watch it.

It trains where ftlaunch put the rank: its GPU over NCCL when ftlaunch chose NCCL (wherever GPUs
are visible), else the CPU over gloo. The Trainer is told so (``use_cpu``, ``ddp_backend``): left
to itself on a node without a GPU it would train every rank alone. ``--deterministic`` is the
Trainer's ``full_determinism`` (deterministic CUDA kernels): with it a resumed run ends
bit-identical to an uninterrupted one on a GPU too, dropout masks included.
"""

import argparse
import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import worker_lib
from worker_lib.integrations.transformers import FaultTolerance

SEED = 1234


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random tokens, the same on every rank and attempt."""

    def __init__(self, size: int = 512, length: int = 16, vocab: int = 64) -> None:
        self.tokens = torch.randint(vocab, (size, length), generator=torch.Generator().manual_seed(SEED))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class Slow(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep after each step")
    p.add_argument("--output-dir", default=None, help="the Trainer's local folder (default: a temporary one)")
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms only")
    p.add_argument("--out", default=None, help="rank 0 writes the final weights there")
    args = p.parse_args()

    fault_tolerance = FaultTolerance()  # opens ftlaunch's checkpoints
    info = worker_lib.info()  # where ftlaunch put this rank: cuda:<local rank> under nccl, else cpu
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix=f"gpt2-rank{os.environ.get('RANK', 0)}-"),
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_steps=args.save_steps,
        save_total_limit=2,  # the Trainer's local copies; ftlaunch keeps its own steps
        logging_steps=5,
        use_cpu=info.device == "cpu",
        ddp_backend=info.backend,
        full_determinism=args.deterministic,
        report_to=[],
        seed=SEED,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model, training, train_dataset=RandomTokens(), callbacks=[fault_tolerance, Slow(args.step_time)]
    )
    resume = fault_tolerance.resume_from()
    if training.process_index == 0:
        print(f"attempt {info.attempt} resumes from {resume} on {training.device}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if training.process_index == 0:
        print(f"final: step {trainer.state.global_step}", flush=True)
        if args.out:
            torch.save({name: value.cpu() for name, value in model.state_dict().items()}, args.out)
    worker_lib.shutdown()


if __name__ == "__main__":
    main()
