"""Train a small classifier with Accelerate (DDP) under ftlaunch, and survive crashes and
preemptions with worker_lib's ``save_state`` and ``load_state``.

    ftlaunch --nproc 2 --checkpoint-dir runs/accelerate examples/accelerate_train.py --epochs 5

What the adapter adds to Accelerate: ``save_state`` commits every rank's ``accelerator.save_state``
as one step on any fsspec URL (Accelerate alone writes local folders); ``load_state`` loads the
newest step every rank committed, never a torn folder; ``after_step`` beats (a stuck collective is
found and the group restarted) and says when a preemption asks every rank to save and stop at one
agreed step. Accelerate restores each rank's RNG streams; this script shuffles by epoch (a seedable
sampler) and skips the batches it had done (``skip_first_batches``), so a run with a crash ends
where an uninterrupted one would.
``--step-time`` slows each step down, to watch it.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
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
    p.add_argument("--out", default=None, help="rank 0 writes the final weights there")
    args = p.parse_args()

    # A seedable sampler shuffles by (seed, epoch) alone; the default one draws from a generator that
    # save_state does not keep, so a resumed epoch would be shuffled as the first one was.
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset(), batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step, loss = fault_tolerance.load_state(accelerator) or 0, None
    if accelerator.is_main_process:
        print(f"attempt {worker_lib.info().attempt} starts at step {step}", flush=True)
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
            torch.save(accelerator.unwrap_model(model).state_dict(), args.out)
    worker_lib.shutdown()


if __name__ == "__main__":
    main()
