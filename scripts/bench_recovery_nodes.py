"""Recovery of a job on two nodes after a worker on node 1 is SIGKILLed: ftlaunch and torchrun.

    python scripts/bench_recovery_nodes.py [--nproc 2] [--repeats 5]

Two "nodes" on this machine, each its own launcher process, meeting on 127.0.0.1 through
torch.distributed.elastic's c10d rendezvous (torchrun: --rdzv-backend c10d; ftlaunch: node 0's
store), gloo over loopback. The workload is scripts/bench_worker.py; the last rank (node 1's
last local rank) SIGKILLs itself at step 10, once. Recovery = death → every rank of the new
group finished its first step, from the same worker-side CLOCK_MONOTONIC stamps for both
launchers; ftlaunch's phases come from each node's event log. torchrun runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see bench_recovery.py: with its defaults a restarted gloo
group reads the dead group's addresses).
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from bench_recovery import (
    ROOT,
    WORKER,
    _cell,
    _first_step_done,
    _stamps,
    ftlaunch_phases,
    kill_tree,
    read_events,
)

PHASES = ["detect", "other node told", "stop", "spawn", "first step", "total"]
NODES = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_all(commands: List[List[str]], env: Dict[str, str]) -> List[subprocess.Popen]:
    return [
        subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for cmd in commands
    ]


def _wait_all(procs: List[subprocess.Popen], timeout: float) -> bool:
    """True when every node exited 0; past ``timeout``, every node and its tree is killed."""
    try:
        return all(proc.wait(timeout) == 0 for proc in procs)
    except subprocess.TimeoutExpired:
        for proc in procs:
            _run_bounded_kill(proc)
        return False


def _run_bounded_kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        kill_tree(proc)


def run_ftlaunch(nproc: int, work: Path, env: Dict[str, str]) -> Optional[Dict[str, float]]:
    out, logs = work / "out", work / "logs"
    out.mkdir(parents=True)
    endpoint = f"127.0.0.1:{_free_port()}"
    world = nproc * NODES
    commands = [
        [
            sys.executable, "-m", "launcher",
            "--nnodes", str(NODES), "--node-rank", str(node), "--rdzv-endpoint", endpoint,
            "--nproc", str(nproc), "--max-failures", "1",
            "--log-dir", str(logs), "--run-dir", str(work / "runs"),
            str(WORKER), "--out", str(out), "--crash-rank", str(world - 1),
        ]
        for node in range(NODES)
    ]  # fmt: skip
    if not _wait_all(_start_all(commands, env), 300):
        return None
    failing, other = (
        read_events(logs / "node1" / "events.jsonl"),
        read_events(logs / "node0" / "events.jsonl"),
    )
    stamps = _stamps(out)
    phases = ftlaunch_phases([failing, other], stamps, world)
    seen = stamps["death"] + phases["detect"]  # when node 1's supervisor had the exit status
    phases["other node told"] = next(e["t_mono"] for e in other if e["event"] == "peer_interrupt") - seen
    return phases


def run_torchrun(nproc: int, work: Path, env: Dict[str, str]) -> Optional[Dict[str, float]]:
    out = work / "out"
    out.mkdir(parents=True)
    endpoint = f"127.0.0.1:{_free_port()}"
    world = nproc * NODES
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(NODES), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", work.name,
        "--max-restarts", "1",
        str(WORKER), "--out", str(out), "--crash-rank", str(world - 1),
    ]  # fmt: skip
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if not _wait_all(_start_all([command] * NODES, env), 300):
        return None
    stamps = _stamps(out)
    return {"total": _first_step_done(stamps, world) - stamps["death"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="workers per node")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    timed: Dict[str, list] = {"ftlaunch": [], "torchrun (c10d)": []}
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-nodes-"))
    try:
        for i in range(args.repeats):  # interleaved, so both see the same machine load
            timed["ftlaunch"].append(run_ftlaunch(args.nproc, work / f"ft{i}", env))
            timed["torchrun (c10d)"].append(run_torchrun(args.nproc, work / f"tr{i}", env))
            print(f"run {i + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nRecovery after SIGKILL of a rank on node 1, {NODES} nodes x {args.nproc} workers on "
        f"loopback, {args.repeats} runs each: median (min–max), milliseconds\n"
    )
    print("| launcher | " + " | ".join(PHASES) + " | recovered |")
    print("|---" * (len(PHASES) + 2) + "|")
    for name, runs in timed.items():
        ok = [r for r in runs if r is not None]
        cells = [_cell([r[phase] for r in ok if phase in r]) for phase in PHASES]
        print(f"| {name} | " + " | ".join(cells) + f" | {len(ok)}/{len(runs)} |")


if __name__ == "__main__":
    main()
