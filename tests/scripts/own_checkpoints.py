"""A torchrun-style script that keeps its own checkpoints (no worker_lib, no heartbeats): each rank
resumes from its own progress file; --fail-rank runs --steps-per-attempt steps and exits 1, the
others step until they are stopped, until --total steps are done. ftlaunch sees no progress of
it: it must not call that "no progress"."""

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
    # Only --fail-rank stops after --steps-per-attempt: the others go on until they are stopped
    # with the group, or are done. (Stopping them too, to wait, bet on their being as far as the
    # failing rank when it failed: one that started later, or was stopped a step short, ended the
    # last attempt a step short, waiting for good.)
    ran = 0
    while step < args.total:
        if RANK == args.fail_rank and ran == args.steps_per_attempt:
            print(f"rank {RANK} fails at step {step}", flush=True)
            os._exit(1)
        time.sleep(args.step_time)
        step += 1
        ran += 1
        tmp = mine.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, mine)
    print(f"rank {RANK} done at step {step}", flush=True)


if __name__ == "__main__":
    main()
