"""A torchrun-style script that keeps its own checkpoints (no worker_lib, no heartbeats): each
attempt resumes from its own progress file, runs --steps-per-attempt steps, and then --fail-rank
exits 1, until --total steps are done. ftlaunch sees no progress of it: it must not call that
"no progress"."""

import argparse
import os
import time
from pathlib import Path

RANK = int(os.environ["RANK"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--total", type=int, default=30)
    p.add_argument("--steps-per-attempt", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.4)
    p.add_argument("--fail-rank", type=int, default=1)
    args = p.parse_args()
    mine = args.dir / f"rank_{RANK}.step"
    step = int(mine.read_text()) if mine.exists() else 0
    for _ in range(args.steps_per_attempt):
        if step >= args.total:
            print(f"rank {RANK} done at step {step}", flush=True)
            return
        time.sleep(args.step_time)
        step += 1
        tmp = mine.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, mine)
    if RANK == args.fail_rank and step < args.total:
        print(f"rank {RANK} fails at step {step}", flush=True)
        os._exit(1)
    while step < args.total and RANK != args.fail_rank:  # wait to be stopped with the group
        time.sleep(0.1)


if __name__ == "__main__":
    main()
