"""The fork server benchmark's workload: DDP over gloo, a worker_lib checkpoint every few steps,
one rank SIGKILLed once, right after a checkpoint was committed.

Stamps (CLOCK_MONOTONIC, shared by every process on the machine) go to ``--out``: when the rank
died, and when each rank process finished its first step. The same script runs under torchrun
(``--checkpoint-dir`` then names the storage) and under ftlaunch.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import worker_lib as ft


def stamp(out: Path, name: str) -> None:
    (out / f"{name}.tmp").write_text(repr(time.monotonic()))
    (out / f"{name}.tmp").rename(out / name)


def model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])


def resume(checkpoint_dir, width: int):
    """Join the group, build the model and its optimizer, load the newest committed step:
    (info, model, optimizer, DDP wrapper, the step to start from)."""
    info = ft.init(checkpoint_dir=checkpoint_dir)
    net = model(width)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    ckpt = ft.load_checkpoint()
    start = 0
    if ckpt is not None:
        net.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start = ckpt.step
    return info, net, optimizer, DDP(net), start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=512, help="4 layers of width²: 512 → 4 MB of weights")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-at", type=int, default=12)
    args = p.parse_args()
    info, net, optimizer, ddp, start = resume(args.checkpoint_dir, args.width)
    for step in range(start, args.steps):
        if info.rank == args.crash_rank and step == args.crash_at and not (args.out / "death").exists():
            stamp(args.out, "death")
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(step * 100 + info.rank))
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == start:
            stamp(args.out, f"first_step.rank_{info.rank}.pid_{os.getpid()}")
        if (step + 1) % args.save_every == 0:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
            ft.save_checkpoint(step + 1, state, replicated=True, blocking=True)
    dist.barrier()
    ft.shutdown()


if __name__ == "__main__":
    main()
