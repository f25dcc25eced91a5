"""The goodput benchmark's workload: DDP over gloo for a fixed wall-clock time, a worker_lib
checkpoint every --save-every steps (asynchronous, as a user would save), and the last rank
SIGKILLed every --crash-every seconds of the run's wall clock; with --memory-every, a snapshot
into ftlaunch's node-local memory tier that often as well.

Rank 0 appends each finished step to ``<out>/steps`` ("<monotonic> <step> <pid>"); the attempt
that reaches the end writes the step it trained to into ``<out>/final``. The same script runs
under torchrun (``--checkpoint-dir`` then names the storage) and under ftlaunch.
"""

import argparse
import itertools
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_ddp_worker import resume

import worker_lib as ft


def crash_due(out: Path, started: float, every: float, duration: float) -> bool:
    """Whether a crash is due now and not yet done (each one is claimed by a file, once)."""
    due = min(int((time.time() - started) // every), int((duration - 1e-6) // every))
    for k in range(1, due + 1):
        try:
            os.close(os.open(out / f"crash_{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            continue
    return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--started", type=float, required=True, help="time.time() at launch")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--crash-every", type=float, default=20.0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--memory-every", type=int, default=0, help="steps between memory snapshots (0: none)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    info, net, optimizer, ddp, start = resume(args.checkpoint_dir, args.width)
    last = info.rank == dist.get_world_size() - 1
    steps = open(args.out / "steps", "a", buffering=1) if info.rank == 0 else None
    for step in itertools.count(start):
        if last and crash_due(args.out, args.started, args.crash_every, args.duration):
            os.kill(os.getpid(), signal.SIGKILL)
        over = torch.tensor([float(time.time() >= args.started + args.duration)])
        dist.all_reduce(over, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if over.item():
            break
        x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(step * 100 + info.rank))
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if steps is not None:
            steps.write(f"{time.monotonic()} {step + 1} {os.getpid()}\n")
        state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
        if (step + 1) % args.save_every == 0:
            ft.save_checkpoint(step + 1, state, replicated=True)
        if args.memory_every and (step + 1) % args.memory_every == 0:
            ft.save_checkpoint(step + 1, state, to="memory")
    if info.rank == 0:
        (args.out / "final").write_text(str(step))
    dist.barrier()
    ft.shutdown()


if __name__ == "__main__":
    main()
