"""Goodput under repeated crashes: a DDP job that runs for a fixed wall-clock time while its last
rank is SIGKILLed every 20 s; the share of the wall time that went into steps the run kept.

    python scripts/bench_goodput.py [--nproc 4] [--duration 120] [--crash-every 20]

The workload is scripts/bench_goodput_worker.py (worker_lib checkpoints every 50 steps,
asynchronous; after a crash the group resumes from the newest committed step, so the steps since
then are done twice). The memory rows also snapshot every step into ftlaunch's node-local memory
tier; the GCS rows save to a GCS emulator on 127.0.0.1 instead of the local disk. Goodput = the
time spent on the steps the run kept / wall time, the wall
time from the launch to the launcher's exit: start-up, every recovery, the steps done twice and
the shutdown all count against it. Goodput counts a slower step as time well spent, so each row
also says its steps kept against the fault-free row's (the same job, no crash, no memory
snapshot, in the same wall time): the figure a slower step cannot flatter. ftlaunch (with and
without its fork server) and torchrun (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see
bench_recovery.py) run one after the other; the fault-free row runs first, whatever --only says.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from bench_recovery import ROOT, _run_bounded

sys.path.insert(0, str(ROOT / "tests"))  # the storage servers the tests use
from storage_servers import start_gcs  # noqa: E402

WORKER = ROOT / "scripts" / "bench_goodput_worker.py"
FAULT_FREE = "ftlaunch, fault-free (no crash, no memory)"
LAUNCHERS = [
    FAULT_FREE,
    "ftlaunch, fork server",
    "ftlaunch, no fork server",
    "torchrun",
    "ftlaunch, memory every step",
    "ftlaunch, GCS emulator",
    "ftlaunch, GCS emulator, memory every step",
]


def _command(launcher: str, args, work: Path) -> List[str]:
    crash_every = args.crash_every if launcher != FAULT_FREE else args.duration * 2  # never due
    crashes = int((args.duration - 1e-6) // crash_every)
    script = [
        str(WORKER), "--out", str(work / "out"), "--started", repr(time.time()),
        "--duration", str(args.duration), "--crash-every", str(crash_every),
        *(["--memory-every", "1"] if "memory" in launcher else []),
    ]  # fmt: skip
    storage = ["--checkpoint-dir", f"gcs://bench/{work.name}"] if "GCS" in launcher else []
    if launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.nproc), "--max-restarts", str(crashes),
            *script, "--checkpoint-dir", str(work / "ckpt"),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "launcher", "--nproc", str(args.nproc), "--max-failures", str(crashes),
        "--log-dir", str(work / "logs"), "--run-dir", str(work / "runs"), *storage,
        *(["--no-fork-server"] if "no fork" in launcher else []), *script,
    ]  # fmt: skip


def _kept_time(lines: List[str]) -> tuple:
    """(seconds spent on the steps the run kept, the median step time). The steps file holds
    every attempt's rank 0 in turn; an attempt's steps are kept up to where any later attempt
    resumed. A step's time is the gap since its process's previous step; the first step of a
    process (start-up, DDP's first construction) counts the median instead."""
    attempts: Dict[str, List[tuple]] = {}  # pid → [(step, stamp)], in the order they ran
    for line in lines:
        stamp, step, pid = line.split()
        attempts.setdefault(pid, []).append((int(step), float(stamp)))
    gaps = {pid: [b[1] - a[1] for a, b in zip(rows, rows[1:])] for pid, rows in attempts.items()}
    median = statistics.median(g for pid_gaps in gaps.values() for g in pid_gaps)
    kept, resumed_at = 0.0, float("inf")
    for pid, rows in reversed(list(attempts.items())):
        durations = [median, *gaps[pid]]
        kept += sum(d for (step, _), d in zip(rows, durations) if step <= resumed_at)
        resumed_at = min(resumed_at, rows[0][0] - 1)
    return kept, median


def run_once(launcher: str, args, work: Path, gcs: Dict[str, str]) -> Optional[Dict[str, float]]:
    (work / "out").mkdir(parents=True)
    env = {**os.environ, **(gcs if "GCS" in launcher else {})}
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    launched = time.monotonic()
    code = _run_bounded(_command(launcher, args, work), env, args.duration * 3 + 120)
    wall = time.monotonic() - launched
    final = work / "out" / "final"
    if code != 0 or not final.exists():
        kept = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-goodput-failed-"))
        shutil.copytree(work, kept, dirs_exist_ok=True)
        print(f"{launcher}: exit {code}; its logs are kept in {kept}", file=sys.stderr)
        return None
    lines = (work / "out" / "steps").read_text().splitlines()
    kept = int(final.read_text())
    kept_time, step = _kept_time(lines)
    return {
        "wall": wall,
        "crashes": len(list((work / "out").glob("crash_*"))),
        "kept": kept,
        "redone": len(lines) - kept,
        "step": step,
        "goodput": kept_time / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--crash-every", type=float, default=20.0)
    p.add_argument("--only", default="", help="rows whose name contains one of these (separated by |)")
    args = p.parse_args()
    results = {}
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-goodput-"))
    server, gcs = start_gcs(work)
    try:
        gcs = {**gcs, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        _make_bucket(gcs)
        for k, launcher in enumerate(LAUNCHERS):
            if any(name in launcher for name in args.only.split("|")) or launcher == FAULT_FREE:
                results[launcher] = run_once(launcher, args, work / str(k), gcs)
                print(f"{launcher}: done", file=sys.stderr)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nGoodput: {args.nproc} workers, DDP over gloo for {args.duration:g} s, the last rank SIGKILLed "
        f"every {args.crash_every:g} s, checkpoints every 50 steps\n"
    )
    print(
        "| launcher | wall time | crashes | steps kept | steps kept / fault-free | done twice (per crash) "
        "| median step | goodput |"
    )
    print("|---|---|---|---|---|---|---|---|")
    fault_free = results.get(FAULT_FREE)
    for launcher, r in results.items():
        if r is None:
            print(f"| {launcher} | failed | | | | | | |")
            continue
        per_crash = f"{r['redone'] / r['crashes']:.1f}" if r["crashes"] else "-"
        ratio = f"{r['kept'] / fault_free['kept']:.1%}" if fault_free else "-"
        print(
            f"| {launcher} | {r['wall']:.1f} s | {r['crashes']} | {r['kept']} | {ratio} "
            f"| {r['redone']} ({per_crash}) | {r['step'] * 1000:.1f} ms | {r['goodput']:.1%} |"
        )


def _make_bucket(env: Dict[str, str]) -> None:
    """The emulator's bucket, made by a client of its own (the workers connect through env)."""
    import fsspec

    fs = fsspec.filesystem("gcs", token="anon", endpoint_url=env["FSSPEC_GCS_ENDPOINT_URL"])
    fs.mkdir("bench")


if __name__ == "__main__":
    main()
