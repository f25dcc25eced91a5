"""Heartbeats: what a beat costs, what watching them costs, how fast a hang is caught.

    python scripts/bench_heartbeat.py [--workers 64] [--seconds 10] [--hangs 10]

1. Cost of ``ft.heartbeat(step)`` in a tight loop beside an empty function call (median and
   p99 of 1000-call batches, per call).
2. Supervisor CPU while --workers processes (worker_lib only, no torch) beat at 1 kHz, beside
   torchrun's agent on the same workers (torchrun watches exits only).
3. Hang detection: rank 1 stops beating in each of --hangs attempts, --heartbeat-timeout 2 s;
   detection latency = the supervisor's "hung" verdict minus the worker's last beat, and the time
   from there until the restarted group runs. torchrun on the same hang, given --torchrun-wait
   seconds to notice.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import psutil

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "scripts" / "bench_heartbeat_worker.py"
sys.path.insert(0, str(ROOT))


def beat_cost(batches: int = 2000, size: int = 1000) -> List[List[str]]:
    from worker_lib import heartbeat

    def empty(step: int = -1) -> None:
        pass

    rows = []
    for name, fn in (("ft.heartbeat(step)", heartbeat), ("empty function", empty)):
        per_call = []
        for _ in range(batches):
            start = time.perf_counter_ns()
            for i in range(size):
                fn(i)
            per_call.append((time.perf_counter_ns() - start) / size)
        per_call.sort()
        rows.append(
            [name, f"{statistics.median(per_call):.0f} ns", f"{per_call[int(0.99 * len(per_call))]:.0f} ns"]
        )
    return rows


def _cpu_of(argv: List[str], seconds: float, env: dict) -> float:
    """CPU seconds the launcher process itself used (children excluded), per wall second."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    me = psutil.Process(proc.pid)
    time.sleep(seconds * 0.2)  # past start-up: measure the steady state
    before, t0 = me.cpu_times(), time.monotonic()
    time.sleep(seconds * 0.6)
    after, t1 = me.cpu_times(), time.monotonic()
    proc.wait(timeout=seconds * 4 + 60)
    used = (after.user - before.user) + (after.system - before.system)
    return used / (t1 - t0)


def supervisor_cpu(workers: int, seconds: float, work: Path) -> List[List[str]]:
    args = [str(WORKER), "--rate", "1000", "--seconds", str(seconds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ours = _cpu_of(
        [sys.executable, "-m", "launcher", "--nproc", str(workers), "--run-dir", str(work / "cpu"), *args],
        seconds,
        env,
    )
    torchrun = _cpu_of(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers), *args], seconds, env
    )
    return [
        [f"ftlaunch, {workers} workers beating at 1 kHz", f"{100 * ours:.1f}% of a core"],
        ["torchrun, same workers (exits only)", f"{100 * torchrun:.1f}% of a core"],
    ]


def detection(hangs: int, timeout: float, work: Path, torchrun_wait: float) -> List[List[str]]:
    out, logs = work / "hang_out", work / "hang_logs"
    out.mkdir()
    args = [str(WORKER), "--rate", "100", "--seconds", "2", "--hang-at", "50"]
    args += ["--hang-attempts", str(hangs), "--out", str(out)]
    subprocess.run(
        [sys.executable, "-m", "launcher", "--nproc", "2", "--heartbeat-timeout", str(timeout)]
        + ["--max-failures", str(hangs), "--log-dir", str(logs), "--run-dir", str(work / "runs")]
        # every attempt hangs on purpose: neither a crash loop nor a reason to back off
        + ["--crash-loop", "0", "--backoff", "0", *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=hangs * (timeout + 15) + 60,
    )
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    latency, restart = [], []
    for attempt in range(hangs):
        silent_since = float((out / f"silent_since.attempt_{attempt}").read_text())
        (hang,) = [e for e in events if e["event"] == "hang" and e["attempt"] == attempt]
        running = [e for e in events if e.get("new") == "RUNNING" and e["attempt"] == attempt + 1]
        latency.append(hang["t_mono"] - silent_since)
        restart.append(running[0]["t_mono"] - hang["t_mono"])
    med = statistics.median
    rows = [
        [f"ftlaunch --heartbeat-timeout {timeout:g}", f"{med(latency):.2f} s", f"{max(latency):.2f} s"],
        [
            "  of which past the deadline",
            f"{med(latency) - timeout:.2f} s",
            f"{max(latency) - timeout:.2f} s",
        ],
        ["  then: stacks, stop, restart running", f"{med(restart):.2f} s", f"{max(restart):.2f} s"],
    ]
    rows.append(["torchrun, same hang", _torchrun_on_a_hang(work, torchrun_wait), ""])
    return rows


def _torchrun_on_a_hang(work: Path, wait: float) -> str:
    out = work / "torchrun_out"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    argv += [str(WORKER), "--rate", "100", "--seconds", "2", "--hang-at", "50", "--hang-attempts", "1"]
    argv += ["--out", str(out)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        proc.wait(timeout=wait)
        return f"ended by itself after {wait:g} s?"  # it never does: the hung rank sleeps forever
    except subprocess.TimeoutExpired:
        return f"not detected in {wait:g} s"
    finally:
        _kill_tree(proc.pid)


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _table(title: str, header: List[str], rows: List[List[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--hangs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--torchrun-wait", type=float, default=30.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftlaunch-bench-hb-") as tmp:
        work = Path(tmp)
        _table("Cost of one call (1000-call batches)", ["call", "median", "p99"], beat_cost())
        _table(
            f"Launcher CPU while {args.workers} workers beat (steady state, {args.seconds:g} s run)",
            ["launcher", "CPU"],
            supervisor_cpu(args.workers, args.seconds, work),
        )
        _table(
            f"Hang detection over {args.hangs} hangs (rank 1 stops beating; 2 ranks)",
            ["", "median", "max"],
            detection(args.hangs, args.timeout, work, args.torchrun_wait),
        )


if __name__ == "__main__":
    main()
