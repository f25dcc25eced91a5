"""Train a small classifier on the handwritten digits data set with DDP, and survive crashes.

    ftlaunch --nproc 2 --checkpoint-dir runs/digits examples/train.py --epochs 20 --crash-at-step 150

The data set (1,797 8x8 images, 10 classes) ships inside scikit-learn: no download. Importing
it costs every new worker about 2 s of CPU on a small machine, at every restart: ftlaunch's fork
server imports only torch, worker_lib and the storage libraries ahead (the script's own imports
run in the worker, as under torchrun); ``ftlaunch --preload sklearn.datasets`` imports it once
(a restart then takes 0.3 s instead of 2.2 s here; docs/gpus.md says what a preload shares). Every
``--checkpoint-every`` steps the model and optimizer are saved through worker_lib (replicated: the
state is the same on every rank, so rank 0 uploads it once; each rank's RNG goes with it). The save
is copied to memory at the call and written in the background; a crash mid-save never destroys the
last committed checkpoint. After a restart every rank loads the newest committed step and continues
from it, in the same data order.

On GPUs (ftlaunch chose NCCL: each rank trains on its own GPU) it follows the GPU recipe: a
snapshot of each rank's state into ftlaunch's node-local memory tier after every step, and storage
every ``--checkpoint-every`` steps. A crash then costs only the step it interrupted: the new group
loads the newest snapshot every rank holds, unless storage has a newer step. On CPUs (the demo) it
takes no snapshots unless ``--memory-every`` asks: there the copy shares the cores with training.

``--save-as files`` saves the other way worker_lib offers, for scripts that write their own files
(torch.save, save_pretrained, torch.distributed.checkpoint): rank 0 writes ``model.pt`` and
``optimizer.pt`` into the step's directory (``ft.checkpoint_dir``), and a restart reads them back from
the newest committed one (``ft.latest_checkpoint_dir``).

Under torchrun (no ftlaunch) pass the storage yourself: ``--checkpoint-dir URL`` (any fsspec URL).
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import worker_lib as ft

SEED = 1234


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-dir", default=None, help="fsspec URL (default: ftlaunch's)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument(
        "--save-as",
        choices=["state", "files"],
        default="state",
        help="state: ft.save_checkpoint (default); files: torch.save into ft.checkpoint_dir",
    )
    p.add_argument(
        "--memory-every",
        type=int,
        default=None,
        help="steps between snapshots into ftlaunch's memory tier (0: none; default: 1 on GPUs, 0 on CPUs)",
    )
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="kill one rank there, first attempt only, once the checkpoint saved before it is committed "
        "(so the step it resumes from is known, however slow the machine)",
    )
    p.add_argument("--crash-rank", type=int, default=1)
    args = p.parse_args()
    if args.memory_every and args.save_as == "files":
        p.error("--memory-every: memory snapshots hold a state (--save-as state), not files")
    return args


def memory_every(args, device: torch.device) -> int:
    """Steps between memory snapshots: --memory-every, else the GPU recipe (every step) where
    ftlaunch gave the node a memory tier and the rank trains on a GPU, where the copy is the
    device's; none on CPUs, where it would take cores from training, nor under plain torchrun."""
    if args.memory_every is not None:
        return args.memory_every
    tier = ft.contract.FT_MEMORY_DIR in os.environ  # ftlaunch's, in /dev/shm
    return 1 if tier and device.type == "cuda" and args.save_as == "state" else 0


def load_data():
    """The same split on every rank and every attempt: a seeded permutation of the data set."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def build_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)


def restore(model, optimizer, save_as: str) -> int:
    """The step to continue from: the newest checkpoint every rank completed, or 0."""
    if save_as == "files":
        folder = ft.latest_checkpoint_dir()
        if folder is None:
            return 0
        state = {name: torch.load(Path(folder, f"{name}.pt")) for name in ("model", "optimizer", "step")}
    else:
        ckpt = ft.load_checkpoint()
        if ckpt is None:
            return 0
        state = {**ckpt.state, "step": ckpt.step}
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def save(step: int, model, optimizer, loss, save_as: str) -> None:
    """Every rank calls it; the state is the same everywhere, so rank 0 alone writes it."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    metrics = {"loss": loss.item()}
    if save_as == "files":
        with ft.checkpoint_dir(step, metrics) as folder:
            if dist.get_rank() == 0:  # the others' folders stay empty
                for name, value in {**state, "step": step}.items():
                    torch.save(value, Path(folder, f"{name}.pt"))
    else:
        ft.save_checkpoint(step, state, metrics=metrics, replicated=True)


@torch.no_grad()
def evaluate(model, data: TensorDataset, device) -> tuple:
    x, y = data.tensors[0].to(device), data.tensors[1].to(device)
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def maybe_crash(args, step: int, rank: int) -> None:
    """The injected crash: every rank first waits for the save in flight (rank 0 until it is
    committed), then meets the others, so the crash never races the commit before it."""
    if ft.info().attempt != 0 or step != args.crash_at_step:
        return
    ft.wait_for_checkpoint()
    dist.barrier()
    if rank == args.crash_rank:
        print(f"rank {rank}: injected crash at step {step} (SIGKILL)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def train(args, device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    snapshot_every = memory_every(args, device)
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = build_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = restore(model, optimizer, args.save_as)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if step and rank == 0:
        print(f"resumed from checkpoint at step {step}", flush=True)
    steps_per_epoch, started, loss = len(loader), time.monotonic(), None
    for epoch in range(step // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)  # the data order depends on the epoch only: resumes replay it
        for index, (x, y) in enumerate(loader):
            if epoch * steps_per_epoch + index < step:
                continue  # done before the restart
            maybe_crash(args, step, rank)
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            ft.heartbeat(step)  # progress: a rank that stops beating is a hang, and is restarted
            if ft.should_stop(step):  # Ctrl+C or a preemption: every rank saves this same step
                save(step, model, optimizer, loss, args.save_as)
                if rank == 0:
                    print(f"stopping at step {step} on request; run the same command to resume", flush=True)
                return
            if snapshot_every and step % snapshot_every == 0:  # this rank's state, in the node's memory
                ft.save_checkpoint(
                    step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, to="memory"
                )
            if step % args.checkpoint_every == 0:
                save(step, model, optimizer, loss, args.save_as)
        if rank == 0:
            test_loss, acc = evaluate(model, test_set, device)
            print(
                f"epoch {epoch + 1}/{args.epochs} step {step} train loss {loss.item():.4f} "
                f"test loss {test_loss:.4f} accuracy {acc:.3f}",
                flush=True,
            )
    if loss is not None and step % args.checkpoint_every:
        save(step, model, optimizer, loss, args.save_as)  # the finished model, too
    if rank == 0:
        test_loss, acc = evaluate(model, test_set, device)
        print(
            f"final: step {step}, test loss {test_loss:.4f}, test accuracy {acc:.3f} "
            f"({time.monotonic() - started:.1f}s in this attempt)",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    info = ft.init(checkpoint_dir=args.checkpoint_dir)  # process group: nccl on GPUs, gloo on CPUs
    train(args, torch.device(info.device))
    ft.shutdown()  # waits for the last save, leaves the group cleanly


if __name__ == "__main__":
    main()
