"""The stragglers benchmark's workload: DDP over gloo, a step of real compute (an MLP of
``--width``, forward and backward), one ft.heartbeat a step, nothing marked for ftlaunch.
``--slow-rank R --slow-after T --slow-factor F``: from T seconds in, rank R's compute takes F times as
long (it waits (F-1) times its own compute again, as a slower device would take: spinning would
take the CPU the other ranks share on a small machine); it writes ``<out>/slow_since`` (wall time)
then. Rank 0 writes ``<out>/steps.json``: each step's wall time, past the first ``--warmup``.
Runs ``--steps`` steps, or until ftlaunch asks it to stop; the same script runs under torchrun."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import worker_lib as ft

RANK = int(os.environ["RANK"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-after", type=float, default=0.0, help="seconds from the first step")
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(4)]
    model = DDP(torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())]))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(64, args.width)
    times = []
    first, slow = time.perf_counter(), False
    for step in range(args.steps):
        began = time.perf_counter()
        if RANK == args.slow_rank and not slow and began - first >= args.slow_after:
            slow = True
            (args.out / "slow_since").write_text(repr(time.time()))
        computed = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        if slow:
            # forward's time stands for the step's compute: waited again (F-1) times before backward
            time.sleep((args.slow_factor - 1) * 3 * (time.perf_counter() - computed))
        loss.backward()
        opt.step()
        ft.heartbeat(step)
        times.append(time.perf_counter() - began)
        if ft.should_stop(step):
            break
    if RANK == 0:
        (args.out / "steps.json").write_text(json.dumps(times[args.warmup :]))
    # No teardown: torch's can deadlock with gloo and DDP (found here, with torchrun as with
    # ftlaunch): the main thread, holding the GIL, joins gloo's run loop as the reducer goes,
    # while that thread waits for the GIL to free a finished work's state.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
