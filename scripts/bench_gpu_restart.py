"""A GPU worker back at work after a crash: ftlaunch with a warm spare, without one, and torchrun,
side by side, phase by phase, at two sizes of model + AdamW state.

    python scripts/bench_gpu_restart.py                      # one GPU: ~2 minutes on an H200
    python scripts/bench_gpu_restart.py --device cpu --sizes 40   # a dry run without a GPU (gloo)

The workload is scripts/bench_gpu_restart_worker.py, one rank: DDP, AdamW, a storage checkpoint
every 10 steps (blocking, so it is committed before the crash), and under ftlaunch a memory-tier
snapshot after every step (torchrun has no memory tier: it resumes from storage and does the steps
since again). The rank SIGKILLs itself in step 12, after its backward; with a warm spare on a GPU,
once the spare is warm and has registered the rank's memory-tier slots (the steady state: a restart
never waits for a spare still warming up, it forks the rank instead, as "no spare"). Every figure is
read from the worker's own CLOCK_MONOTONIC stamps, from that death: when the new process ran its
script's first line (started), had its process group and its device ready (ready), had built its
model, loaded the checkpoint into it and built DDP (loaded), finished its first step, and finished
the interrupted step again (total). ftlaunch's own line on what a spare costs (its GPU memory, as
NVML counts it) is printed below the table.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from bench_recovery import ROOT, kill_tree

WORKER = ROOT / "scripts" / "bench_gpu_restart_worker.py"
LAUNCHERS = ["ftlaunch, warm spare", "ftlaunch, no spare", "torchrun"]
PHASES = ["started", "ready", "loaded", "first step", "steps redone", "total"]
# "ready" and "loaded" in their parts (seconds, each after the one before)
PARTS = ["imports", "group", "model built", "checkpoint in", "DDP"]
CRASH_AT = 12


def _command(launcher: str, args, size: float, work: Path) -> List[str]:
    worker = [
        str(WORKER), "--out", str(work / "out"), "--checkpoint-dir", str(work / "ckpt"),
        "--state-mb", str(size), "--device", args.device, "--crash-at", str(CRASH_AT),
    ]  # fmt: skip
    if launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "--max-restarts", "1", *worker,
        ]  # fmt: skip
    spare = "on" if "warm spare" in launcher else "off"
    if spare == "on" and args.device == "cuda":  # the steady state: the spare warm, its slots registered
        worker.append("--crash-when-spared")
    return [
        sys.executable, "-m", "launcher", "--nproc", "1", "--max-failures", "1", "--warm-spare", spare,
        *(["--backend", "gloo"] if args.device == "cpu" else []),
        "--log-dir", str(work / "logs"), "--run-dir", str(work / "runs"), *worker, "--memory",
    ]  # fmt: skip


def run_once(launcher: str, args, size: float, work: Path) -> Optional[Dict[str, float]]:
    """The phases of one run (seconds; "steps redone" a count), and ftlaunch's spare line; None
    when it did not recover within the bound."""
    (work / "out").mkdir(parents=True)
    env = dict(os.environ)
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see bench_recovery.py
        if args.device == "cpu":
            env["FTLAUNCH_BACKEND"] = "gloo"  # what worker_lib uses outside ftlaunch
    proc = subprocess.Popen(
        _command(launcher, args, size, work),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return None
    if proc.returncode != 0:
        print(
            f"{launcher} at {size:g} MB failed (exit {proc.returncode}):\n{err.decode()[-2000:]}",
            file=sys.stderr,
        )
        return None
    out = work / "out"
    result = phases({p.name: float(p.read_text()) for p in out.iterdir() if not p.name.endswith(".tmp")})
    spare = re.search(r"warm spare: .*", err.decode())
    return {**result, "spare_line": spare.group(0) if spare else ""}


def phases(stamps: Dict[str, float]) -> Dict[str, float]:
    death, start = stamps["death"], int(stamps["a1.resumed_at"])
    return {
        "started": stamps["a1.started"] - death,
        "ready": stamps["a1.ready"] - stamps["a1.started"],
        "loaded": stamps["a1.loaded"] - stamps["a1.ready"],
        "first step": stamps[f"a1.step_{start}"] - stamps["a1.loaded"],
        "steps redone": float(CRASH_AT - start),
        "total": stamps[f"a1.step_{CRASH_AT}"] - death,
        "imports": stamps["a1.imported"] - stamps["a1.started"],
        "group": stamps["a1.ready"] - stamps["a1.imported"],
        "model built": stamps["a1.built"] - stamps["a1.ready"],
        "checkpoint in": stamps["a1.restored"] - stamps["a1.built"],
        "DDP": stamps["a1.loaded"] - stamps["a1.restored"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--sizes", type=float, nargs="+", default=[400, 1600], help="MB of model + AdamW state")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120, help="seconds before a run counts as hung")
    args = p.parse_args()
    results: Dict[tuple, list] = {}
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-gpu-"))
    try:
        for size in args.sizes:
            for i in range(args.repeats):  # interleaved, so all three see the same machine
                for k, launcher in enumerate(LAUNCHERS):
                    run = run_once(launcher, args, size, work / f"s{size:g}_{i}_{k}")
                    results.setdefault((launcher, size), []).append(run)
                print(f"{size:g} MB: run {i + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print_table(args, results)


def _device_name(device: str) -> str:
    if device == "cpu":
        return "CPU (gloo), a dry run"
    import torch

    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"


def _cell(values: List[float], count: bool = False) -> str:
    if not values:
        return "—"
    if count:
        return f"{statistics.median(values):g}"
    return f"{statistics.median(values):.2f}" + (
        f" ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else ""
    )


def _print_table(args, results: Dict[tuple, list]) -> None:
    print(
        f"\n{_device_name(args.device)}; one rank SIGKILLed in step {CRASH_AT}, {args.repeats} run(s) each; "
        "seconds from the death (median (min–max)); each phase after the one before\n"
    )
    print("| state | launcher | " + " | ".join(PHASES) + " | × torchrun | recovered |")
    print("|---" * (len(PHASES) + 4) + "|")
    for size in args.sizes:
        base = [r["total"] for r in results[("torchrun", size)] if r is not None]
        for launcher in LAUNCHERS:
            runs = results[(launcher, size)]
            ok = [r for r in runs if r is not None]
            cells = [_cell([r[ph] for r in ok], count=ph == "steps redone") for ph in PHASES]
            totals = [r["total"] for r in ok]
            ratio = f"{statistics.median(totals) / statistics.median(base):.2f}" if totals and base else "—"
            print(
                f"| {size:g} MB | {launcher} | " + " | ".join(cells) + f" | {ratio} | {len(ok)}/{len(runs)} |"
            )
    print('\n"ready" and "loaded" in their parts (seconds, median):\n')
    print("| state | launcher | " + " | ".join(PARTS) + " |")
    print("|---" * (len(PARTS) + 2) + "|")
    for size in args.sizes:
        for launcher in LAUNCHERS:
            ok = [r for r in results[(launcher, size)] if r is not None]
            print(
                f"| {size:g} MB | {launcher} | " + " | ".join(_cell([r[p] for r in ok]) for p in PARTS) + " |"
            )
    lines = {r["spare_line"] for runs in results.values() for r in runs if r is not None and r["spare_line"]}
    for line in sorted(lines):
        print(f"\nftlaunch: {line}")


if __name__ == "__main__":
    main()
