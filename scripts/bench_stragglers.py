"""What measuring each rank's own work costs, and how soon a slow rank is named (issue 52).

    python scripts/bench_stragglers.py [--rounds 5] [--steps 400] [--detections 3] [--balanced 10]

1. Cost: the same DDP job (1 node, 2 ranks over gloo, an MLP step of real compute), runs
   interleaved: ftlaunch measuring its ranks' own work (its default: torch's flight recorder on,
   a thread reading it every 2 s), ftlaunch not measuring (TORCH_FR_BUFFER_SIZE=0: neither), and
   torchrun. The median step of each run (rank 0's, past 20 steps of warm-up); the table gives
   each arm's median and range over the rounds, so the noise is read beside the difference.
2. Detection: 2 loopback nodes × 2 ranks, the default --straggler-window (30 s) and factor; rank 3's
   compute made 2× slower 45 s in; the seconds from the slowdown to node 0's ``straggler`` event.
   torchrun has no straggler report: it never names one.
3. False names: the same job balanced, ``--balanced`` runs of ``--balanced-seconds`` each: how many
   times anyone was named.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from bench_heartbeat import _table  # a Markdown table, as the other benches print theirs
from bench_recovery import ROOT, kill_tree

WORKER = Path(__file__).resolve().parent / "bench_stragglers_worker.py"
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
ARMS = ["ftlaunch, own work measured", "ftlaunch, not measured (TORCH_FR_BUFFER_SIZE=0)", "torchrun"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_run(arm: str, args, work: Path) -> Optional[float]:
    out = work / "out"
    out.mkdir(parents=True)
    script = [str(WORKER), "--steps", str(args.steps), "--out", str(out)]
    if arm == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *script]
    else:
        cmd = [sys.executable, "-m", "launcher", "--nproc", "2", "--run-dir", str(work / "runs"), *script]
    env = {**ENV, "TORCH_FR_BUFFER_SIZE": "0"} if "not measured" in arm else ENV
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)
    steps = out / "steps.json"
    if done.returncode != 0 or not steps.exists():
        print(f"{arm}: exit {done.returncode}\n{done.stderr.decode()[-2000:]}", file=sys.stderr)
        return None
    return statistics.median(json.loads(steps.read_text()))


def cost(args, work: Path) -> List[List[str]]:
    medians = {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        for arm in ARMS[round_ % 3 :] + ARMS[: round_ % 3]:  # each arm first in turn
            step = _one_run(arm, args, work / f"cost_{round_}_{ARMS.index(arm)}")
            if step is not None:
                medians[arm].append(step * 1e3)
    base = statistics.median(medians[ARMS[1]]) if medians[ARMS[1]] else None
    rows = []
    for arm, found in medians.items():
        if not found:
            rows.append([arm, "failed", "", ""])
            continue
        mid = statistics.median(found)
        versus = f"{100 * (mid / base - 1):+.1f}%" if base else ""
        rows.append([arm, f"{mid:.2f} ms", f"{min(found):.2f}–{max(found):.2f} ms", versus])
    return rows


def _job(work: Path, *extra: str) -> List[subprocess.Popen]:
    """2 loopback nodes × 2 ranks of the worker, node 1 first."""
    endpoint = f"127.0.0.1:{_port()}"
    (work / "out").mkdir(parents=True)
    procs = []
    for node in (1, 0):
        cmd = [
            sys.executable, "-m", "launcher", "--nnodes", "2", "--node-rank", str(node),
            "--rdzv-endpoint", endpoint, "--nproc", "2", "--log-dir", str(work / f"logs{node}"),
            "--run-dir", str(work / "runs"), str(WORKER), "--steps", "100000000", "--out", str(work / "out"),
            *extra,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return procs


def _named(work: Path) -> List[dict]:
    """Node 0's straggler events so far (whole lines: it may be writing one)."""
    path = work / "logs0" / "node0" / "events.jsonl"
    if not path.exists():
        return []
    *ended, _ = path.read_text().split("\n")
    return [e for e in map(json.loads, ended) if e.get("event") == "straggler" and not e["back"]]


def _end(procs: List[subprocess.Popen]) -> None:
    procs[1].send_signal(signal.SIGTERM)  # node 0: every rank stops at one step
    for proc in procs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            kill_tree(proc)


def detection(args, work: Path) -> List[List[str]]:
    delays, missed = [], 0
    for run in range(args.detections):
        folder = work / f"detect_{run}"
        procs = _job(folder, "--slow-rank", "3", "--slow-after", "45")
        deadline = time.monotonic() + 45 + 120
        while not _named(folder) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        named = _named(folder)
        since = folder / "out" / "slow_since"
        _end(procs)
        if named and since.exists():
            delays.append(named[0]["t_wall"] - float(since.read_text()))
        else:
            missed += 1
    rows = [
        ["ftlaunch (--straggler-window 30s, factor 1.5)", *_spread(delays), f"{missed} of {args.detections}"]
    ]
    return rows + [["torchrun", "never (no straggler report)", "", ""]]


def _spread(values: List[float]) -> List[str]:
    if not values:
        return ["-", "-"]
    return [f"{statistics.median(values):.1f} s", f"{min(values):.1f}–{max(values):.1f} s"]


def false_names(args, work: Path) -> List[List[str]]:
    named = 0
    for run in range(args.balanced):
        folder = work / f"balanced_{run}"
        procs = _job(folder)
        deadline = time.monotonic() + args.balanced_seconds
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        named += len(_named(folder))
        _end(procs)
    return [[f"{args.balanced} balanced runs of {args.balanced_seconds:g} s", str(named)]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--detections", type=int, default=3)
    p.add_argument("--balanced", type=int, default=10)
    p.add_argument("--balanced-seconds", type=float, default=60.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftlaunch-bench-stragglers-") as tmp:
        work = Path(tmp)
        _table(
            f"Median step, 1 node × 2 ranks, {args.rounds} interleaved rounds of {args.steps} steps",
            ["arm", "median", "range over rounds", "vs not measured"],
            cost(args, work),
        )
        _table(
            f"From a rank's slowdown (2× its compute) to its name, {args.detections} runs",
            ["", "median", "range", "missed"],
            detection(args, work),
        )
        _table("Names on a balanced job (2 nodes × 2 ranks)", ["", "ranks named"], false_names(args, work))


if __name__ == "__main__":
    main()
