"""Train a small classifier with Accelerate (DDP) under ftlaunch, and survive crashes and
preemptions with worker_lib's ``save_state`` and ``load_state``.

    ftlaunch --nproc 2 --checkpoint-dir runs/accelerate examples/accelerate_train.py --epochs 5

What the adapter adds to Accelerate: ``save_state`` commits every rank's ``accelerator.save_state``
as one step on any fsspec URL (Accelerate alone writes local folders); ``load_state`` loads the
newest step every rank committed, never a torn folder; ``after_step`` beats (a stuck collective is
found and the group restarted) and says when a preemption asks every rank to save and stop at one
agreed step. Accelerate restores each rank's RNG streams; this script shuffles by epoch (a seedable
sampler), skips the batches it had done (``skip_first_batches``) and gives its loader a generator of
its own (a new iterator draws from it, not from the stream dropout uses), so a run with a crash
ends where an uninterrupted one would.
``--step-time`` slows each step down, to watch it.

It trains where ftlaunch put the rank: its GPU over NCCL when ftlaunch chose NCCL (wherever GPUs
are visible), else the CPU over gloo. Accelerate is told so (``cpu``): left to itself on a node
without a GPU it would train every rank alone. ``--deterministic`` turns on deterministic
algorithms (Accelerate's ``set_seed(..., deterministic=True)``, with the cuBLAS setting they
need): with it a resumed run ends bit-identical to an uninterrupted one on a GPU too, dropout
masks included (Accelerate restores each rank's CUDA random state).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import worker_lib
from worker_lib.integrations import accelerate as fault_tolerance

SEED = 1234


def dataset(size: int = 1280) -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(size, 32, generator=g)
    return TensorDataset(x, (x @ torch.randn(32, 4, generator=g)).argmax(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--save-every", type=int, default=10, help="optimizer steps")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep in each step")
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms only")
    p.add_argument("--out", default=None, help="rank 0 writes the final weights there")
    args = p.parse_args()

    # ftlaunch's checkpoints, and where ftlaunch put this rank (cuda:<local rank> under nccl, else
    # cpu); Accelerate makes the process group.
    info = worker_lib.init(init_process_group=False)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
    # A seedable sampler shuffles by (seed, epoch) alone; the default one draws from a generator that
    # save_state does not keep, so a resumed epoch would be shuffled as the first one was.
    accelerator = Accelerator(
        cpu=info.device == "cpu", dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    set_seed(SEED, deterministic=args.deterministic)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # A generator of its own: making an iterator (a resume's skip_first_batches) draws a seed from
    # it, not from the global stream that Accelerate restored and dropout draws from.
    loader = DataLoader(dataset(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step, loss = fault_tolerance.load_state(accelerator) or 0, None
    if accelerator.is_main_process:
        print(f"attempt {info.attempt} starts at step {step} on {accelerator.device}", flush=True)
    for epoch in range(step // len(loader), args.epochs):
        loader.set_epoch(epoch)  # the order depends on the epoch only: a resume replays it
        done = step - epoch * len(loader)  # batches of this epoch done before a restart
        for x, y in accelerator.skip_first_batches(loader, done) if done else loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            time.sleep(args.step_time)
            stop = fault_tolerance.after_step(step)
            if stop or step % args.save_every == 0:
                fault_tolerance.save_state(accelerator, step, {"loss": loss.item()})
            if stop:
                if accelerator.is_main_process:
                    print(f"stopping at step {step} on request; run the same command to resume", flush=True)
                worker_lib.shutdown()
                return
    if accelerator.is_main_process:
        print(f"final: step {step}" + (f", loss {loss.item():.4f}" if loss is not None else ""), flush=True)
        if args.out:
            weights = accelerator.unwrap_model(model).state_dict()
            torch.save({name: value.cpu() for name, value in weights.items()}, args.out)
    worker_lib.shutdown()


if __name__ == "__main__":
    main()
