"""The benchmark's workload: gloo all-reduces, one rank (--crash-rank) SIGKILLed at step 10, once.

Writes monotonic timestamps (CLOCK_MONOTONIC is shared by every process on the machine) to
``--out``: when that rank died, and when each rank process finished its first step. Attempts are
told apart by time, not by TORCHELASTIC_RESTART_COUNT: torchrun restarts a healthy node's workers
with their count unchanged.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def stamp(out: Path, name: str) -> None:
    (out / f"{name}.tmp").write_text(repr(time.monotonic()))
    (out / f"{name}.tmp").rename(out / name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--crash-rank", type=int, default=1)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    tensor = torch.zeros(1000)
    for step in range(args.steps):
        if rank == args.crash_rank and step == 10 and not (args.out / "death").exists():
            stamp(args.out, "death")
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(tensor)
        time.sleep(args.step_seconds)
        if step == 0:
            stamp(args.out, f"first_step.rank_{rank}.pid_{os.getpid()}")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see examples/train.py: skip gloo's racy interpreter-shutdown path


if __name__ == "__main__":
    main()
