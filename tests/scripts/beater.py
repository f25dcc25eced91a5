"""A worker that beats every step and, on the first attempt, hangs the way a test asks.

Steps are sleeps (``--step-time``), optionally with a gloo all_reduce each step. The hang is
real: a sleep with no end, SIGSTOP to itself, or (for the other ranks) a collective that never
completes because a peer is hung.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from until import add_option, steps

import worker_lib as ft

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--slow-from", type=int, default=None, help="steps from here take 3x as long")
    p.add_argument(
        "--hang",
        choices=["sleep", "stop", "stop-in-save", "stall", "beat-in-place"],
        help="what the hanging rank does (stop-in-save: SIGSTOP with its heartbeat paused, as in a save; "
        "beat-in-place: beats its last step again and again, forever)",
    )
    p.add_argument("--hang-rank", type=int, default=1, help="-1: every rank")
    p.add_argument("--hang-at", type=int, default=10, help="the step it hangs in (or the first one after)")
    p.add_argument("--hang-attempt", type=int, default=0, help="the attempt in which it hangs")
    p.add_argument("--crash-at", type=int, help="attempt 0: --crash-rank SIGKILLs itself here")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--collective", action="store_true", help="gloo all_reduce every step")
    p.add_argument(
        "--save-mb", type=int, default=0, help="blocking checkpoint save of this size at --save-at"
    )
    p.add_argument("--save-at", type=int, default=5)
    p.add_argument("--no-beat", action="store_true", help="never call ft.heartbeat()")
    p.add_argument("--save-every", type=int, default=0, help="async checkpoint of the step every N steps")
    p.add_argument("--stop-aware", action="store_true", help="save and leave when ft.should_stop(step)")
    p.add_argument("--ready-dir", type=Path, help="write <dir>/rank_<r>.attempt_<a> after the first step")
    add_option(p)
    return p.parse_args()


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def hang(how: str, step: int) -> None:
    print(f"rank {RANK} hangs at step {step} ({how})", flush=True)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == "stop-in-save":  # frozen where a save of its own would be: the heartbeat paused
        with ft.pause_heartbeat():
            os.kill(os.getpid(), signal.SIGSTOP)
    if how == "stall":  # silent for a while, then goes on
        time.sleep(3.0)
        return
    while how == "beat-in-place":  # a loop of its own that beats (a retry, a wait that beats)
        ft.heartbeat(step - 1)
        time.sleep(0.05)
    sleep_forever()


def save(step: int, megabytes: int) -> None:
    import torch

    state = {"weights": torch.zeros(megabytes * 2**20 // 4)}
    started = time.monotonic()
    ft.save_checkpoint(step, state, blocking=True)
    print(f"rank {RANK} saved {megabytes} MB in {time.monotonic() - started:.2f} s", flush=True)


def main() -> None:
    args = parse()
    ft.init(init_process_group=args.collective)
    if args.collective:
        import torch
        import torch.distributed as dist

        ones = torch.ones(4)
    first = 0
    if args.save_every:
        ckpt = ft.load_checkpoint()
        first = ckpt.step + 1 if ckpt else 0
        print(f"rank {RANK} attempt {ATTEMPT} starts at step {first}", flush=True)
    for step in steps(first, args.steps, ATTEMPT, args.until_attempt):
        hanging = args.hang and ATTEMPT == args.hang_attempt and args.hang_rank in (RANK, -1)
        if hanging and (step == args.hang_at if args.hang == "stall" else step >= args.hang_at):
            hang(args.hang, step)  # a stall is one silence of 3 s; the others never return
        if ATTEMPT == 0 and RANK == args.crash_rank and step == args.crash_at:
            print(f"rank {RANK} crashes at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        slow = args.slow_from is not None and step >= args.slow_from
        time.sleep(args.step_time * (3 if slow else 1))
        if args.collective:
            dist.all_reduce(ones)
        if args.save_mb and step == args.save_at:
            save(step, args.save_mb)
        if not args.no_beat:
            ft.heartbeat(step)
        if args.save_every and step % args.save_every == 0:
            ft.save_checkpoint(step, {"step": step})
        if args.stop_aware and ft.should_stop(step):
            ft.save_checkpoint(step, {"step": step}, blocking=True)
            print(f"rank {RANK} stopped at step {step} on request", flush=True)
            break
        if args.ready_dir and step == first:  # it has beaten (and asked should_stop): evidence for tests
            args.ready_dir.mkdir(parents=True, exist_ok=True)
            (args.ready_dir / f"rank_{RANK}.attempt_{ATTEMPT}").touch()
    print(f"rank {RANK} done after {args.steps} steps", flush=True)
    sys.stdout.flush()
    ft.shutdown()


if __name__ == "__main__":
    main()
