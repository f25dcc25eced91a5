"""Cold start and recovery of a DDP job with a checkpoint to load: ftlaunch with its fork server
(with and without a warm spare per rank: on CPU, a worker forked ahead), ftlaunch without it, and
torchrun, side by side.

    python scripts/bench_fork_server.py [--nproc 2 4] [--repeats 5]

The workload is scripts/bench_ddp_worker.py: DDP over gloo, a worker_lib checkpoint (blocking,
replicated) every 10 steps, rank 1 SIGKILLed at step 12, once; the new group loads step 10.
Cold start = launch → every rank finished its first step. Recovery = death → every rank of the
new group finished its first step (checkpoint loaded, DDP built), from the same worker-side
CLOCK_MONOTONIC stamps for all three. ftlaunch's phases come from its event log. torchrun runs
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see bench_recovery.py).

``--against CHECKOUT`` adds the fork-server row of another commit's checkout (ftlaunch run from
that folder), in the same interleaved runs: an A/B of a change on the same machine load.
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

from bench_recovery import ROOT, _cell, _first_step_done, _run_bounded, _stamps, ftlaunch_phases, read_events

WORKER = ROOT / "scripts" / "bench_ddp_worker.py"
LAUNCHERS = [
    "ftlaunch, fork server",
    "ftlaunch, fork server + warm spare",
    "ftlaunch, no fork server",
    "torchrun",
]
PHASES = ["cold start", "detect", "stop", "spawn", "first step", "total"]


def _cold_start(stamps: Dict[str, float], world: int, launched: float) -> float:
    firsts = [
        min(t for n, t in stamps.items() if n.startswith(f"first_step.rank_{r}.")) for r in range(world)
    ]
    return max(firsts) - launched


def _command(launcher: str, nproc: int, work: Path) -> List[str]:
    out = ["--out", str(work / "out")]
    if launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "1", str(WORKER), *out, "--checkpoint-dir", str(work / "ckpt"),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "launcher", "--nproc", str(nproc), "--max-failures", "1",
        "--log-dir", str(work / "logs"), "--run-dir", str(work / "runs"),
        *(["--no-fork-server"] if "no fork" in launcher else []),
        *(["--warm-spare", "on"] if "warm spare" in launcher else []), str(WORKER), *out,
    ]  # fmt: skip


def run_once(launcher: str, nproc: int, work: Path, tree: Path = ROOT) -> Optional[Dict[str, float]]:
    """One run; ``tree``: the checkout ftlaunch is run from (its folder first on sys.path)."""
    (work / "out").mkdir(parents=True)
    env = (
        {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if launcher == "torchrun"
        else {**os.environ, "PYTHONPATH": str(tree)}
    )
    launched = time.monotonic()
    if _run_bounded(_command(launcher, nproc, work), env, 300, cwd=tree) != 0:
        return None
    stamps = _stamps(work / "out")
    death, first = stamps["death"], _first_step_done(stamps, nproc)
    result = {"cold start": _cold_start(stamps, nproc, launched), "total": first - death}
    if launcher != "torchrun":
        result.update(ftlaunch_phases([read_events(work / "logs" / "events.jsonl")], stamps, nproc))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", type=Path, help="another commit's checkout: its fork-server row too")
    args = p.parse_args()
    trees = {launcher: ROOT for launcher in LAUNCHERS}
    if args.against is not None:
        trees[f"ftlaunch, fork server, from {args.against.resolve()}"] = args.against.resolve()
    results: Dict[tuple, list] = {}
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-fork-"))
    try:
        for nproc in args.nproc:
            for i in range(args.repeats):  # interleaved, so all of them see the same machine load
                for k, (launcher, tree) in enumerate(trees.items()):
                    results.setdefault((launcher, nproc), []).append(
                        run_once(launcher, nproc, work / f"n{nproc}_{i}_{k}", tree)
                    )
                print(f"--nproc {nproc}: run {i + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print_table(args, results, list(trees))


def _print_table(args, results: Dict[tuple, list], launchers: List[str]) -> None:
    print(
        f"\nDDP with a checkpoint to load, rank 1 SIGKILLed at step 12, {args.repeats} runs each: "
        "median (min–max), milliseconds; ratio = median total / torchrun's\n"
    )
    print("| launcher | workers | " + " | ".join(PHASES) + " | ratio | recovered |")
    print("|---" * (len(PHASES) + 4) + "|")
    for nproc in args.nproc:
        base = [r["total"] for r in results[("torchrun", nproc)] if r is not None]
        for launcher in launchers:
            runs = results[(launcher, nproc)]
            ok = [r for r in runs if r is not None]
            cells = [_cell([r[ph] for r in ok if ph in r]) for ph in PHASES]
            totals = [r["total"] for r in ok]
            ratio = f"{statistics.median(totals) / statistics.median(base):.2f}" if totals and base else "—"
            print(f"| {launcher} | {nproc} | " + " | ".join(cells) + f" | {ratio} | {len(ok)}/{len(runs)} |")


if __name__ == "__main__":
    main()
