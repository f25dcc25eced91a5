"""How ftlaunch's recovery and its store traffic grow with the number of nodes, torchrun beside it.

    python scripts/bench_scale.py [--nodes 2,4,8,16] [--window 5] [--workload sleep|poll]

N "nodes" on this machine, each its own launcher process with one tiny worker
(scripts/bench_scale_worker.py: no torch, so that 16 nodes fit on 2 cores), meeting on 127.0.0.1
through torch.distributed.elastic's c10d rendezvous. Once every worker runs, the store's process
(ftlaunch's node 0; the torchrun agent that bound the endpoint) is watched for ``--window``
seconds: the system calls on its TCP sockets per second (strace, in a second window: the store's
traffic, each request at least a read and a write), per node, and every read and write of its
whole process tree (/proc/PID/io: node 0's own cost with ``--workload sleep``, whose workers make
no system call while healthy; ``poll``'s look for a file every 10 ms). Node rank 0's tree (the
launcher whose worker is rank 0) is watched in the same window: for ftlaunch the store's process,
for torchrun whichever agent the rendezvous made node rank 0, which on loopback need not be the one
that bound the endpoint (every agent's host matches 127.0.0.1; the first to bind hosts the store).
Then the last node's worker exits 1 (``sleep``: on the bench's SIGUSR2; ``poll``: on a file), and
from its own stamp (CLOCK_MONOTONIC, one clock for every process here):

- stopped: until every other node's worker got its SIGTERM;
- running: until every node's worker of the new attempt started.

Node 0's tree counts the calls of a job alone when the job has a pid namespace of its own (as in a
container): run it as root under ``unshare --pid --fork --mount-proc``; on a shared machine the
other users' new processes make node 0's look for its workers' groups walk /proc every time.

torchrun runs with its defaults (monitor interval 0.1 s) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(see bench_recovery.py); ftlaunch with its defaults (fork server on, --node-timeout 15 s).
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import psutil
from bench_recovery import ROOT, kill_tree

WORKER = ROOT / "scripts" / "bench_scale_worker.py"
_DEADLINE_S = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ftlaunch(n: int, node: int, endpoint: str, work: Path, workload: str) -> List[str]:
    return [
        sys.executable, "-m", "launcher",
        "--nnodes", str(n), "--node-rank", str(node), "--rdzv-endpoint", endpoint,
        "--nproc", "1", "--max-failures", "1",
        "--log-dir", str(work / "logs"), "--run-dir", str(work / "runs"),
        str(WORKER), "--out", str(work / "out"), "--workload", workload,
    ]  # fmt: skip


def _torchrun(n: int, node: int, endpoint: str, work: Path, workload: str) -> List[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(n), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", work.name,
        "--max-restarts", "1",
        str(WORKER), "--out", str(work / "out"), "--workload", workload,
    ]  # fmt: skip


def _stamps(out: Path, kind: str, after: float = 0.0) -> Dict[int, float]:
    """Each rank's first stamp of ``kind`` ('start', 'stop') later than ``after``."""
    found: Dict[int, float] = {}
    for path in out.glob(f"{kind}.*.*"):
        if path.name.endswith(".tmp"):
            continue
        rank, when = int(path.name.split(".")[1]), float(path.read_text())
        if when > after:
            found[rank] = min(when, found.get(rank, when))
    return found


def _wait_for(ready, procs: List[subprocess.Popen]) -> bool:
    deadline = time.monotonic() + _DEADLINE_S
    while time.monotonic() < deadline:
        if ready():
            return True
        if any(p.poll() not in (None, 0) for p in procs):
            return False
        time.sleep(0.05)
    return False


def _read(path: Path) -> float:
    return float(path.read_text())


def _store_process(port: int) -> Optional[psutil.Process]:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    return None


def _syscalls(proc: psutil.Process) -> int:
    """Read and write system calls of ``proc`` and its children (node 0's whole process tree)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            io = p.io_counters()
            total += io.read_count + io.write_count
        except psutil.Error:
            pass
    return total


def _agent_of(pid: int, agents: List[subprocess.Popen]) -> Optional[psutil.Process]:
    """The launcher process among ``agents`` that ``pid`` descends from (a zygote may sit between)."""
    launched = {a.pid for a in agents}
    try:
        return next((p for p in psutil.Process(pid).parents() if p.pid in launched), None)
    except psutil.Error:
        return None


def _roles(
    out: Path, store: psutil.Process, agents: List[subprocess.Popen]
) -> Tuple[psutil.Process, int, int]:
    """Node rank 0's launcher, and the store host's node rank and launch index (``--nproc 1``: a
    worker's RANK is its node's rank)."""
    ranks = {
        int(p.name.split(".")[2]): int(p.name.split(".")[1])
        for p in out.glob("start.*.*")
        if not p.name.endswith(".tmp")
    }
    by_agent: Dict[int, int] = {}
    for pid, rank in ranks.items():
        agent = _agent_of(pid, agents)
        if agent is not None:
            by_agent[agent.pid] = rank
    (node0,) = [pid for pid, rank in by_agent.items() if rank == 0]
    launch = [a.pid for a in agents].index(store.pid)
    return psutil.Process(node0), by_agent[store.pid], launch


def _socket_calls(pid: int, seconds: float) -> Optional[float]:
    """System calls on TCP sockets per second in process ``pid`` (every thread), counted by strace
    (``-yy`` names each descriptor's kind): the store's traffic alone, server and client sides,
    without the process's other reads (its /proc looks, its logs). None without strace."""
    if shutil.which("strace") is None:
        return None
    calls = "read,write,recvfrom,sendto,recvmsg,sendmsg,readv,writev"
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        subprocess.run(
            ["timeout", "-s", "INT", f"{seconds:g}", "strace", "-f", "-qq", "-yy", "-e", f"trace={calls}",
             "-p", str(pid), "-o", out.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return sum("TCP" in line for line in out) / seconds


def _crash(out: Path, n: int, workload: str) -> None:
    """Have the last rank's worker exit 1: the file it looks for, or SIGUSR2 to its pid."""
    if workload == "poll":
        (out / "go_crash").touch()
        return
    (pid,) = [int(p.name.split(".")[2]) for p in out.glob(f"start.{n - 1}.*") if not p.name.endswith(".tmp")]
    os.kill(pid, signal.SIGUSR2)


def run(
    command, n: int, work: Path, window: float, env: Dict[str, str], workload: str
) -> Optional[Dict[str, Any]]:
    """One launch of ``n`` nodes: the healthy window's figures, then the crash's reach."""
    out = work / "out"
    out.mkdir(parents=True)
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            command(n, node, endpoint, work, workload),
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for node in range(n)
    ]
    try:
        if not _wait_for(lambda: len(_stamps(out, "start")) == n, procs):
            return None
        store = _store_process(port)
        if store is None:  # the store's host ended between its worker's start and this look
            return None
        node0, store_rank, store_launch = _roles(out, store, procs)
        before, before0, started = _syscalls(store), _syscalls(node0), time.monotonic()
        time.sleep(window)  # the measurement window: every node healthy
        elapsed = time.monotonic() - started
        per_s, node0_per_s = (_syscalls(store) - before) / elapsed, (_syscalls(node0) - before0) / elapsed
        sockets = _socket_calls(store.pid, window)  # a second window, under strace
        _crash(out, n, workload)
        crashed = out / "crashed"
        if not _wait_for(lambda: crashed.exists() and len(_stamps(out, "start", _read(crashed))) == n, procs):
            return None
        at = _read(crashed)
        starts, stops = _stamps(out, "start", at), _stamps(out, "stop", at)
        deadline = time.monotonic() + _DEADLINE_S
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
        return {
            "stopped": max(stops.values()) - at if len(stops) == n - 1 else float("nan"),
            "running": max(starts.values()) - at,
            "syscalls": per_s,
            "node0_syscalls": node0_per_s,
            "store_rank": store_rank,
            "store_launch": store_launch,
            "sockets": sockets,
        }
    except subprocess.TimeoutExpired:
        return None
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4,8,16,32", help="comma-separated node counts")
    p.add_argument("--window", type=float, default=5.0, help="seconds the healthy store is watched")
    p.add_argument(
        "--workload", choices=("sleep", "poll"), default="sleep",
        help="sleep: workers that make no system call while healthy; poll: each looks for a file every 10 ms",
    )  # fmt: skip
    args = p.parse_args()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rows = []
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-scale-"))
    try:
        for i, n in enumerate(int(x) for x in args.nodes.split(",")):  # a size may repeat: 16,16,16
            for name, command in (("ftlaunch", _ftlaunch), ("torchrun", _torchrun)):
                result = run(command, n, work / f"{name}{n}_{i}", args.window, env, args.workload)
                rows.append((n, name, result))
                print(f"{n} nodes, {name}: {'done' if result else 'FAILED'}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "\nA worker on the last node exits 1; N nodes x 1 tiny worker on loopback (seconds from its "
        "exit). While healthy, the store's process: system calls on its TCP sockets per second "
        "(strace; the store's traffic, server and client sides) and per node; every read and "
        "write of its process tree and of node rank 0's (its /proc looks included, which grow with "
        "the processes on this one machine); which node rank hosted the store (and its place "
        "in the launch order, from 0)\n"
    )
    print(
        "| nodes | launcher | every node's workers stopped | every node's new workers running | "
        "store socket calls/s | per node | store host's tree, reads+writes/s | node rank 0's tree | "
        "store host: node rank (launched) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, name, r in rows:
        if r is None:
            print(f"| {n} | {name} | failed | failed | — | — | — | — | — |")
            continue
        sockets = "—" if r["sockets"] is None else f"{r['sockets']:.0f} | {r['sockets'] / n:.1f}"
        trees = f"{r['syscalls']:.0f} | {r['node0_syscalls']:.0f} | {r['store_rank']} ({r['store_launch']})"
        print(f"| {n} | {name} | {r['stopped']:.2f} | {r['running']:.2f} | {sockets} | {trees} |")


if __name__ == "__main__":
    main()
