"""Recovery time after a worker is SIGKILLed: ftlaunch phase by phase, torchrun as a whole.

    python scripts/bench_recovery.py [--nproc 4] [--repeats 5]

Both launchers run the same workload (scripts/bench_worker.py), one restart allowed.
Recovery = death → every rank of the restarted group finished its first step. ftlaunch's phases
come from its event log; torchrun exposes no such events, so only its whole recovery is measured
(from the same worker-side timestamps).

torchrun 2.13 with its defaults shares its rendezvous store with the workers across restarts,
and the restarted gloo group reads the dead group's addresses (pytorch issue 135712): it fails
or hangs. Its timed row therefore uses the documented workaround
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; how often the defaults recover is counted separately.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "scripts" / "bench_worker.py"
PHASES = ["detect", "stop", "spawn", "first step", "total"]


def _stamps(out: Path) -> Dict[str, float]:
    return {p.name: float(p.read_text()) for p in out.iterdir() if not p.name.endswith(".tmp")}


def _first_step_done(stamps: Dict[str, float], world: int) -> float:
    """When every rank of the new group had finished its first step after the death."""
    death = stamps["death"]
    return max(
        min(t for name, t in stamps.items() if name.startswith(f"first_step.rank_{r}.") and t > death)
        for r in range(world)
    )


def run_ftlaunch(nproc: int, work: Path) -> Dict[str, float]:
    out, logs = work / "out", work / "logs"
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "--nproc",
        str(nproc),
        "--max-failures",
        "1",
        "--log-dir",
        str(logs),
        "--run-dir",
        str(work / "runs"),  # a fresh run each time, never the repository's ftlaunch_runs/
        str(WORKER),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, timeout=300)
    stamps = _stamps(out)
    return ftlaunch_phases([read_events(logs / "events.jsonl")], stamps, nproc)


def read_events(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ftlaunch_phases(nodes: List[List[dict]], stamps: Dict[str, float], world: int) -> Dict[str, float]:
    """Recovery phase by phase from ftlaunch's event logs (the failing node's first) and the
    workers' stamps; with many nodes, a phase ends when it has ended on every node."""

    def when(events: List[dict], match) -> float:
        return next(e["t_mono"] for e in events if match(e))

    death, first = stamps["death"], _first_step_done(stamps, world)
    seen = next(e["t_observed"] for e in nodes[0] if e["event"] == "worker_exit" and e["exitcode"] != 0)
    stopped = max(when(ev, lambda e: e.get("new") == "STOPPED" and e["attempt"] == 0) for ev in nodes)
    running = max(when(ev, lambda e: e.get("new") == "RUNNING" and e["attempt"] == 1) for ev in nodes)
    return {
        "detect": seen - death,
        "stop": stopped - seen,
        "spawn": running - stopped,
        "first step": first - running,
        "total": first - death,
    }


def run_torchrun(
    nproc: int, work: Path, share_store: bool, timeout: float = 300
) -> Optional[Dict[str, float]]:
    """torchrun's recovery, or None when it did not recover (failed, or hung past ``timeout``)."""
    out = work / "out"
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        str(WORKER),
        "--out",
        str(out),
    ]
    env = dict(os.environ)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if _run_bounded(cmd, env, timeout) != 0:
        return None
    stamps = _stamps(out)
    return {"total": _first_step_done(stamps, nproc) - stamps["death"]}


def _run_bounded(cmd: List[str], env: Dict[str, str], timeout: float, cwd: Path = ROOT) -> Optional[int]:
    """Run ``cmd``; past ``timeout`` kill it and every descendant, by pid. None: timed out."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return None


def kill_tree(proc: subprocess.Popen) -> None:
    """``proc`` and every descendant, by pid."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    for child in tree:
        child.kill()
    proc.kill()
    proc.wait()
    psutil.wait_procs(tree, timeout=10)


def _cell(values: List[float]) -> str:
    if not values:
        return "—"
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}–{max(ms):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--default-torchrun-runs", type=int, default=3, help="runs of torchrun's defaults")
    p.add_argument("--hang-timeout", type=float, default=60, help="seconds before a run counts as hung")
    args = p.parse_args()
    timed = {"ftlaunch": [], "torchrun, unshared store": []}
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-"))
    try:
        for i in range(args.repeats):  # interleaved, so both see the same machine load
            timed["ftlaunch"].append(run_ftlaunch(args.nproc, work / f"ft{i}"))
            timed["torchrun, unshared store"].append(
                run_torchrun(args.nproc, work / f"tr{i}", share_store=False)
            )
            print(f"run {i + 1}/{args.repeats} done", file=sys.stderr)
        defaults = [
            run_torchrun(args.nproc, work / f"td{i}", share_store=True, timeout=args.hang_timeout)
            for i in range(args.default_torchrun_runs)
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print_table(args, timed, defaults)


def _print_table(args, timed: Dict[str, List[Optional[Dict[str, float]]]], defaults: list) -> None:
    print(
        f"\nRecovery after SIGKILL of rank 1, --nproc {args.nproc}, {args.repeats} runs each: "
        "median (min–max), milliseconds\n"
    )
    print("| launcher | " + " | ".join(PHASES) + " | recovered |")
    print("|---" * (len(PHASES) + 2) + "|")
    for name, runs in timed.items():
        ok = [r for r in runs if r is not None]
        cells = [_cell([r[phase] for r in ok if phase in r]) for phase in PHASES]
        print(f"| {name} | " + " | ".join(cells) + f" | {len(ok)}/{len(runs)} |")
    recovered = sum(r is not None for r in defaults)
    print("| torchrun, defaults | " + " | ".join("—" for _ in PHASES) + f" | {recovered}/{len(defaults)} |")


if __name__ == "__main__":
    main()
