"""A worker that does one thing for a test: crash, hang, trap signals, spawn children, dump env.

Every behaviour is real: os._exit, SIGKILL to itself, a NULL dereference, an uncaught
exception, a blocking sleep. It imports torch only where the behaviour needs it.
"""

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--fail", choices=["exit", "sigkill", "segv", "raise"], help="how the chosen rank dies")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument(
        "--fail-when-all-ready",
        action="store_true",
        help="the failing rank waits until every rank of the attempt is ready (needs --ready-dir)",
    )
    p.add_argument("--fail-attempts", default="0", help="comma list of attempts that fail, or 'all'")
    p.add_argument("--fail-after", type=float, default=0.3, help="seconds before failing")
    p.add_argument(
        "--others",
        choices=["sleep", "exit0", "wait"],
        default="exit0",
        help="what other ranks do; wait: sleep (until stopped) in an attempt where a rank fails, else exit0",
    )
    p.add_argument(
        "--beat", action="store_true", help="ft.heartbeat(0) first: no attempt gets past step 0 (no progress)"
    )
    p.add_argument("--run-for", type=float, default=1.0, help="seconds the others run before exit0")
    p.add_argument("--sleeper", type=int, help="this rank sleeps (until stopped) instead of exiting 0")
    p.add_argument(
        "--exit-file",
        type=Path,
        help="the others write their pid to it as they exit 0; the failing rank waits (up to 120 s) "
        "until that process is gone (reaped by ftlaunch, so its exit is recorded) before --fail-after",
    )
    p.add_argument("--ready-dir", type=Path, help="write <dir>/rank_<r>.attempt_<a>.pid once started")
    p.add_argument("--env-dir", type=Path, help="dump the environment to <dir>/rank_<r>.attempt_<a>.json")
    p.add_argument(
        "--trap",
        choices=["report", "ignore", "interrupt"],
        help="INT/TERM/HUP: print and exit 0, ignore, or raise KeyboardInterrupt (Python ends by SIGINT)",
    )
    p.add_argument("--grandchild", choices=["group", "session"], help="start a `sleep` child")
    p.add_argument("--spam", type=int, default=0, help="print this many long lines fast")
    p.add_argument("--no-newline", action="store_true", help="end with a line without newline")
    p.add_argument(
        "--progress-mb", type=int, default=0, help="write this many MB of \\r progress, no newline"
    )
    p.add_argument(
        "--go-file", type=Path, help="after the progress, wait (up to 120 s) until this file exists"
    )
    return p.parse_args()


def attempt_fails(args: argparse.Namespace) -> bool:
    """A rank fails in this attempt."""
    if args.fail is None:
        return False
    return args.fail_attempts == "all" or str(ATTEMPT) in args.fail_attempts.split(",")


def fails_now(args: argparse.Namespace) -> bool:
    return RANK == args.fail_rank and attempt_fails(args)


def all_ready(ready_dir: Path) -> None:
    """Until every rank of this attempt wrote its ready file (120 s at most)."""
    deadline, world = time.monotonic() + 120, int(os.environ["WORLD_SIZE"])
    while len(list(ready_dir.glob(f"rank_*.attempt_{ATTEMPT}.pid"))) < world and time.monotonic() < deadline:
        time.sleep(0.02)


def die(how: str) -> None:
    print(f"rank {RANK} about to fail by {how}", flush=True)
    if how == "exit":
        os._exit(1)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "segv":
        ctypes.string_at(0)  # a real NULL dereference
    if how == "raise":
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def train() -> None:
            raise ValueError(f"boom on rank {RANK}")

        train()


def progress_bar(rank: int, megabytes: int) -> bytes:
    """What tqdm writes: a carriage return before each update, never a newline."""
    update = f"\rrank {rank} progress ".encode()
    count = megabytes * 2**20 // (len(update) + 10)
    return b"".join(update + b"%09d|" % i for i in range(count))


def trap(mode: str) -> None:
    def report(signum, _frame):
        print(f"rank {RANK} got {signal.Signals(signum).name}", flush=True)
        time.sleep(0.3)  # as a save in the handler would: a second delivery would run it again
        sys.exit(0)

    handler = {"report": report, "ignore": signal.SIG_IGN, "interrupt": signal.default_int_handler}[mode]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def start_grandchild(mode: str) -> None:
    child = subprocess.Popen(["sleep", "1000"], start_new_session=(mode == "session"))
    print(f"rank {RANK} grandchild {child.pid}", flush=True)


def wait_until_gone(exit_file: Path) -> None:
    """Until the process named in ``exit_file`` is gone (a zombie still answers kill 0: only the
    supervisor's reaping, which records the exit, ends the wait); bounded."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(int(exit_file.read_text()), 0)
        except FileNotFoundError:
            pass
        except ProcessLookupError:
            return
        time.sleep(0.02)


def main() -> None:
    args = parse()
    if args.trap:
        trap(args.trap)
    if args.env_dir:
        args.env_dir.mkdir(parents=True, exist_ok=True)
        (args.env_dir / f"rank_{RANK}.attempt_{ATTEMPT}.json").write_text(json.dumps(dict(os.environ)))
    if args.grandchild:
        start_grandchild(args.grandchild)
    for i in range(args.spam):
        print(f"rank {RANK} line {i} " + "x" * 200)
    if args.progress_mb:
        sys.stdout.buffer.write(progress_bar(RANK, args.progress_mb))
        sys.stdout.flush()
    deadline = time.monotonic() + 120
    while args.go_file and not args.go_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    # Said before the ready file: a test that signals this rank once it is ready must not land
    # its handler's line inside this one (print writes the text and its newline apart).
    print(f"rank {RANK} attempt {ATTEMPT} started", flush=True)
    if args.ready_dir:
        args.ready_dir.mkdir(parents=True, exist_ok=True)
        ready = args.ready_dir / f"rank_{RANK}.attempt_{ATTEMPT}.pid"
        ready.with_suffix(".tmp").write_text(str(os.getpid()))
        ready.with_suffix(".tmp").rename(ready)  # whole, or not there at all
    if args.beat:
        import worker_lib as ft

        ft.heartbeat(0)
    if fails_now(args):
        if args.exit_file:
            wait_until_gone(args.exit_file)
        if args.fail_when_all_ready:
            all_ready(args.ready_dir)
        time.sleep(args.fail_after)
        die(args.fail)
    if args.others == "sleep" or (args.others == "wait" and attempt_fails(args)) or RANK == args.sleeper:
        time.sleep(1000)
    time.sleep(args.run_for)
    if args.no_newline:
        print(f"rank {RANK} last words", end="", flush=True)
    if args.exit_file:
        # Every rank that exits 0 writes it: each through its own temporary name, or two ranks
        # exiting together race for one (a rename that finds nothing fails the rank).
        tmp = args.exit_file.with_name(f"{args.exit_file.name}.{os.getpid()}.tmp")
        tmp.write_text(str(os.getpid()))
        tmp.rename(args.exit_file)  # whole, or not there at all


if __name__ == "__main__":
    main()
