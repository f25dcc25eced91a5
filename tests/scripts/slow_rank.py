"""DDP over gloo with a step of real work (``--work`` seconds of the rank's own: its batch is
"loaded" for that long, as a slow disk or a slow GPU would take), one beat a step. ``--slow-rank R
--slow-from S --slow-factor F``: from step S, rank R's own work takes F times as long; it writes
``<out>/slow_since`` (the wall time) at that step, so that a test can time the report; after
``--slow-steps`` it is back to speed. ``--hang-rank R --hang-at S``: rank R sleeps for good before step
S, while the others enter its backward's all_reduce and wait there (a hang's culprit). Steps on
until ftlaunch asks it to stop (``ft.should_stop``), for ``--longest`` seconds at most. It works
without the script marking anything for ftlaunch: only ``ft.heartbeat``."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import worker_lib as ft

RANK = int(os.environ["RANK"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=float, default=0.05, help="seconds of the rank's own work a step")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--slow-steps", type=int, default=10**9, help="steps it stays slow, then back to speed")
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank sleeps for good at --hang-at")
    p.add_argument(
        "--hang-at", type=int, default=0, help="before this step's forward: the others wait in its backward"
    )
    p.add_argument("--longest", type=float, default=240.0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + args.longest
    step = 0
    while time.monotonic() < deadline:
        if RANK == args.hang_rank and step == args.hang_at:
            print(f"rank {RANK} hangs before step {step}", flush=True)
            while True:
                time.sleep(3600)
        slow = RANK == args.slow_rank and args.slow_from <= step < args.slow_from + args.slow_steps
        if RANK == args.slow_rank and step == args.slow_from:
            (args.out / "slow_since").write_text(str(time.time()))
        time.sleep(args.work * (args.slow_factor if slow else 1.0))  # the batch, loaded
        x = torch.randn(8, 64)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # the all-reduce: the others wait here for the slow one
        opt.step()
        ft.heartbeat(step)
        if ft.should_stop(step):
            break
        step += 1
    dist.destroy_process_group()
    # No interpreter teardown: freeing DDP's reducer can deadlock with gloo in torch (the main
    # thread, holding the GIL, joins gloo's run loop, which waits for the GIL): seen in a bench.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
