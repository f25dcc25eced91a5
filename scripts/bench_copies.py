"""What the memory copies to other nodes cost (issue 51.6): the goodput bench's job (DDP over gloo,
a memory snapshot every step, storage every 50, the last rank SIGKILLed every 20 s) on 2 loopback
nodes of 2 ranks, with the copies off (--memory-peers 0) and on (1), runs interleaved, beside
torchrun's 2 agents running the same job without memory (its c10d rendezvous on loopback).

    python scripts/bench_copies.py [--duration 60] [--repeats 2] [--nproc 2]

Steps kept: the steps of the run's final course (scripts/bench_goodput_worker.py writes them). The
copies' lag (newest snapshot − the step the peer holds, from each node's copies_noted events) and
the bytes a second each node sent are printed beside them.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from bench_goodput import WORKER
from bench_recovery import ROOT, kill_tree

ROWS = [
    "ftlaunch, copies off (--memory-peers 0)",
    "ftlaunch, copies on (--memory-peers 1)",
    "torchrun, no memory",
]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _commands(row: str, args, work: Path) -> List[List[str]]:
    """One command a node, node 1 first."""
    crashes = int((args.duration - 1e-6) // args.crash_every)
    script = [
        str(WORKER), "--out", str(work / "out"), "--started", repr(time.time()),
        "--duration", str(args.duration), "--crash-every", str(args.crash_every),
    ]  # fmt: skip
    endpoint = f"127.0.0.1:{_port()}"
    commands = []
    for node in (1, 0):
        if row.startswith("torchrun"):
            launch = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--nproc-per-node", str(args.nproc),
                "--max-restarts", str(crashes), *script, "--checkpoint-dir", str(work / "ckpt"),
            ]  # fmt: skip
        else:
            peers = "1" if "copies on" in row else "0"
            launch = [
                sys.executable, "-m", "launcher", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-endpoint", endpoint, "--nproc", str(args.nproc), "--max-failures", str(crashes),
                "--memory-peers", peers, "--log-dir", str(work / f"logs{node}"),
                "--run-dir", str(work / "runs"),
                *script, "--memory-every", "1",
            ]  # fmt: skip
        commands.append(launch)
    return commands


def run_once(row: str, args, work: Path) -> Optional[Dict[str, float]]:
    (work / "out").mkdir(parents=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launched = time.monotonic()
    procs = [
        subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for cmd in _commands(row, args, work)
    ]
    deadline = launched + args.duration * 3 + 120
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            codes.append(None)
    wall = time.monotonic() - launched
    final = work / "out" / "final"
    if codes != [0, 0] or not final.exists():
        print(f"{row}: exits {codes}; its logs are kept in {work}", file=sys.stderr)
        return None
    lines = (work / "out" / "steps").read_text().splitlines()
    kept = int(final.read_text())
    lags, sent = [], []
    for node in (0, 1):
        notes = _copies_noted(work / f"logs{node}")
        lags += [n["newest"] - n["copied"] for n in notes if n["copied"] >= 0]
        sent.append(notes[-1]["sent"] / wall if notes else 0.0)
    return {
        "wall": wall,
        "kept": kept,
        "redone": len(lines) - kept,
        "lag": statistics.median(lags) if lags else None,
        "lag_max": max(lags) if lags else None,
        "sent": max(sent) if sent else 0.0,
    }


def _copies_noted(logs: Path) -> List[dict]:
    """The node's copies_noted events, in order ([] without copies)."""
    found = []
    for events in logs.glob("**/events.jsonl"):
        for line in events.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "copies_noted":
                found.append(record)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--crash-every", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    results: Dict[str, List[Dict[str, float]]] = {row: [] for row in ROWS}
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-copies-"))
    for repeat in range(args.repeats):
        order = ROWS if repeat % 2 == 0 else [ROWS[1], ROWS[0], ROWS[2]]  # interleaved: on/off alike
        for row in order:
            r = run_once(row, args, work / f"{repeat}-{ROWS.index(row)}")
            if r is not None:
                results[row].append(r)
            print(f"{row} ({repeat + 1}/{args.repeats}): done", file=sys.stderr)
    print(
        f"\nCopies' cost: 2 loopback nodes x {args.nproc} ranks, DDP over gloo for {args.duration:g} s, a "
        f"memory snapshot every step (ftlaunch), storage every 50, the last rank SIGKILLed every "
        f"{args.crash_every:g} s; {args.repeats} run(s) each, interleaved\n"
    )
    print(
        "| launcher | runs | steps kept (each run) | steps kept / copies off "
        "| copy lag, median (max) steps | bytes/s sent by a node |"
    )
    print("|---|---|---|---|---|---|")
    off = results[ROWS[0]]
    off_kept = statistics.median(r["kept"] for r in off) if off else None
    for row, runs in results.items():
        if not runs:
            print(f"| {row} | failed | | | | |")
            continue
        kept = statistics.median(r["kept"] for r in runs)
        ratio = f"{kept / off_kept:.1%}" if off_kept else "-"
        lags = [r["lag"] for r in runs if r["lag"] is not None]
        most = max((r["lag_max"] for r in runs if r["lag_max"] is not None), default=0)
        lag = f"{statistics.median(lags):.0f} ({most:.0f})" if lags else "-"
        sent = statistics.median(r["sent"] for r in runs)
        each = ", ".join(str(r["kept"]) for r in runs)
        print(f"| {row} | {len(runs)} | {kept:.0f} ({each}) | {ratio} | {lag} | {sent / 1e6:.1f} MB/s |")


if __name__ == "__main__":
    main()
