"""A run to be watched from outside (tests/test_metrics.py): it beats every step, snapshots its
state to the memory tier every 2 steps and saves it to storage every 5 (through worker_lib), and
fails as asked: rank --crash-rank SIGKILLs itself in attempt 0 at --crash-at, rank 0 stops beating
in attempt 1 at --hang-at (a hang), and the last attempt holds still at --steps, beating, until
--release exists, then ends."""

import argparse
import os
import signal
import time
from pathlib import Path

import torch

import worker_lib as ft

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--crash-at", type=int, default=12)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--hang-at", type=int, default=0, help="0: no hang")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--release", type=Path, required=True)
    return p.parse_args()


def main() -> None:
    args = parse()
    info = ft.init()
    loaded = ft.load_checkpoint()
    state = loaded.state if loaded is not None else {"w": torch.zeros(4)}
    step = loaded.step if loaded is not None else 0
    print(f"attempt {ATTEMPT} starts at step {step}", flush=True)
    while step < args.steps:
        step += 1
        state["w"] += 1.0
        ft.heartbeat(step)
        if ATTEMPT == 0 and step == args.crash_at and info.rank == args.crash_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if ATTEMPT == 1 and step == args.hang_at and info.rank == 0:
            while True:  # alive, silent: the heartbeat deadline finds it
                time.sleep(1.0)
        if step % 2 == 0:
            ft.save_checkpoint(step, state, to="memory")
        if step % 5 == 0:
            ft.save_checkpoint(step, state, replicated=True)
        time.sleep(args.step_time)
    ft.wait_for_checkpoint()
    deadline = time.monotonic() + 300
    while not args.release.exists() and time.monotonic() < deadline:
        ft.heartbeat(step)  # the same step: held still, not hung
        time.sleep(0.1)
    ft.shutdown()


if __name__ == "__main__":
    main()
