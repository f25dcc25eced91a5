"""The tiny worker of scripts/bench_scale.py: no torch (16 nodes' workers must fit on 2 cores).

It stamps, with CLOCK_MONOTONIC (one clock for every process of this machine), when it starts
and when it is told to stop (SIGTERM, from either launcher), under its rank and pid (torchrun's
restart count is each agent's own, so it cannot tell the generations apart). The last rank exits 1
(stamped ``crashed``), once:

- ``--workload poll``: once the file ``<out>/go_crash`` appears, looked for every 10 ms;
- ``--workload sleep``: on SIGUSR2 from the bench; until then it only sleeps, no system call of
  its own, so that node 0's calls a second are the launcher's alone (what a user's job sees).

A worker started after the crash lives ``--linger`` seconds and exits 0."""

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
    p.add_argument("--workload", choices=("poll", "sleep"), default="poll")
    args = p.parse_args()
    rank, world, pid = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.getpid()

    def stopped(signum, frame) -> None:
        stamp(args.out, f"stop.{rank}.{pid}")
        os._exit(143)

    def crash(signum=None, frame=None) -> None:
        stamp(args.out, "crashed")
        os._exit(1)

    signal.signal(signal.SIGTERM, stopped)
    later = (args.out / "crashed").exists()
    if args.workload == "sleep" and not later and rank == world - 1:
        signal.signal(signal.SIGUSR2, crash)
    stamp(args.out, f"start.{rank}.{pid}")
    deadline = time.monotonic() + (args.linger if later else 600.0)
    while time.monotonic() < deadline:
        if args.workload == "sleep":
            time.sleep(max(0.0, deadline - time.monotonic()))  # woken only by a signal
        elif not later and rank == world - 1 and (args.out / "go_crash").exists():
            crash()
        else:
            time.sleep(0.01)


if __name__ == "__main__":
    main()
