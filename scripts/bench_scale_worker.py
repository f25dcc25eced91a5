"""The tiny worker of scripts/bench_scale.py: no torch (16 nodes' workers must fit on 2 cores).

It stamps, with CLOCK_MONOTONIC (one clock for every process of this machine), when it starts
and when it is told to stop (SIGTERM, from either launcher), under its rank and pid (torchrun's
restart count is each agent's own, so it cannot tell the generations apart). Once the file
``<out>/go_crash`` appears, the last rank exits 1 (stamped ``crashed``), once; a worker started
after that lives ``--linger`` seconds and exits 0."""

import argparse
import os
import signal
import time
from pathlib import Path


def stamp(out: Path, name: str) -> None:
    tmp = out / f"{name}.tmp"
    tmp.write_text(repr(time.monotonic()))
    tmp.rename(out / name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--linger", type=float, default=3.0)
    args = p.parse_args()
    rank, world, pid = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.getpid()

    def stopped(signum, frame) -> None:
        stamp(args.out, f"stop.{rank}.{pid}")
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    stamp(args.out, f"start.{rank}.{pid}")
    later = (args.out / "crashed").exists()
    deadline = time.monotonic() + (args.linger if later else 600.0)
    while time.monotonic() < deadline:
        if not later and rank == world - 1 and (args.out / "go_crash").exists():
            stamp(args.out, "crashed")
            os._exit(1)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
