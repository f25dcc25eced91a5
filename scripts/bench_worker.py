"""The benchmark's workload: gloo all-reduces, rank 1 SIGKILLed at step 10 of the first attempt.

Writes monotonic timestamps (CLOCK_MONOTONIC is shared by every process on the machine) to
``--out``: when rank 1 died, and when each rank finished its first step in each attempt.
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
    args = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    tensor = torch.zeros(1000)
    for step in range(args.steps):
        if attempt == 0 and rank == 1 and step == 10:
            stamp(args.out, "death")
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(tensor)
        time.sleep(args.step_seconds)
        if step == 0:
            stamp(args.out, f"first_step.attempt_{attempt}.rank_{rank}")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see examples/train.py: skip gloo's racy interpreter-shutdown path


if __name__ == "__main__":
    main()
