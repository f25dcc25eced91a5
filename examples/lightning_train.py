"""Train a small classifier with PyTorch Lightning (DDP) under ftlaunch, and survive crashes and
preemptions with the ``FaultTolerance`` callback.

    ftlaunch --nproc 2 --checkpoint-dir runs/lightning examples/lightning_train.py --epochs 5

What the callback adds to Lightning: a step is resumed only when every rank committed it (a kill
in the middle of a save never leaves a torn "last" file to load), on any fsspec URL; each step
beats (a stuck collective is found and the group restarted); a preemption stops every rank at one
agreed step and saves it (Lightning's own SLURM requeue handler is off under ftlaunch, which
gives torchrun's environment). The data (random features, labels from a fixed linear map) is
made in code: nothing is downloaded. ``--step-time`` slows each step down, to watch it.

It trains where ftlaunch put the rank: its GPU when ftlaunch chose NCCL (wherever GPUs are
visible), else the CPU over gloo. ``--deterministic`` is Lightning's ``deterministic=True``
(deterministic CUDA kernels): with it a resume from an epoch's end is bit-identical on a GPU too,
dropout masks included (each rank's CUDA random state is restored with the step).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

import worker_lib
from worker_lib.integrations.lightning import FaultTolerance

SEED = 1234


class Classifier(pl.LightningModule):
    def __init__(self, lr: float, step_time: float) -> None:
        super().__init__()
        torch.manual_seed(SEED)  # the same initial weights on every rank
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4)
        )
        self.lr, self.step_time = lr, step_time

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        time.sleep(self.step_time)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(size: int = 1280) -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(size, 32, generator=g)
    return TensorDataset(x, (x @ torch.randn(32, 4, generator=g)).argmax(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save-every", type=int, default=10, help="optimizer steps")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep in each step")
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms only")
    p.add_argument("--out", default=None, help="rank 0 writes the final weights there")
    args = p.parse_args()

    fault_tolerance = FaultTolerance(every_n_steps=args.save_every)  # opens ftlaunch's checkpoints
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = pl.Trainer(
        accelerator=torch.device(worker_lib.info().device).type,  # "cuda" under nccl, else "cpu"
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local,
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else "auto",
        max_epochs=args.epochs,
        deterministic=args.deterministic,
        callbacks=[fault_tolerance],
        enable_checkpointing=False,  # ftlaunch's steps are the checkpoints
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = Classifier(args.lr, args.step_time)
    loader = DataLoader(dataset(), batch_size=args.batch_size, shuffle=True)  # Lightning shards it
    ckpt_path = fault_tolerance.ckpt_path()
    if trainer.global_rank == 0:
        print(
            f"attempt {worker_lib.info().attempt} starts at step {fault_tolerance.resumed_from or 0} "
            f"on {trainer.strategy.root_device}",
            flush=True,
        )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        print(f"final: step {trainer.global_step}, loss {float(trainer.callback_metrics['train_loss']):.4f}")
        if args.out:
            torch.save({name: value.cpu() for name, value in model.state_dict().items()}, args.out)
    worker_lib.shutdown()


if __name__ == "__main__":
    main()
