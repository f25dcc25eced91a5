"""A training node lost for good: from the kill to the first step at full size, three ways.

    python scripts/bench_standby.py [--repeats 3] [--quick] [--arms standby,relaunch,torchrun]

Three training "nodes" on this machine, one rank each (DDP over gloo on loopback, the workload
scripts/bench_standby_worker.py), meeting through torch.distributed.elastic's c10d rendezvous.
Once every rank is past step --warm-at, the bench SIGKILLs one training node's whole process
tree (its launcher and its workers; never node 0, which hosts the stores). Arms, interleaved:

- standby:  ftlaunch --nnodes 3 --standby-nodes 1 on 4 nodes, --node-timeout 5s; node 2 killed,
            never relaunched: node 3 should take position 2 (GROUP_RANK 2, RANK 2).
- relaunch: ftlaunch --nnodes 3, the same kill; the bench relaunches node 2's command 10 s after
            it (what a person or a scheduler would do, at its fastest).
- torchrun: 4 agents for --nnodes 3 (torch's dynamic rendezvous keeps the 4th in its redundancy
            list and lets it in once the dead participant's keep-alive expires), --rdzv-conf
            keep_alive_interval=1,keep_alive_max_attempt=5 (a dead agent is dropped after 5 s,
            as --node-timeout 5s), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see bench_recovery.py).
            The victim is the participant with the highest GROUP_RANK that does not host the
            rendezvous store.

The figure: kill → every one of the 3 ranks finished the first step of a process started after
the kill, from the workers' CLOCK_MONOTONIC stamps and the kill's time on the same clock.
ftlaunch's phases come from the nodes' event logs: node 0 decides the node is lost, the new
round is met on node 0, the last rank is spawned, the first step at full size.
"""

import argparse
import dataclasses
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, TypeVar

import psutil
from chaos_matrix import marked_processes, read_jsonl  # a run's processes by their marker; events

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "scripts" / "bench_standby_worker.py"
NODE_ENV = "BENCH_NODE"  # which launcher a worker runs under: the worker names its stamps by it
MARKER = "FTLAUNCH_BENCH_STANDBY_MARKER"  # in every launcher's env, inherited by all it starts
NODES = 3
VICTIM = 2  # ftlaunch's node rank killed
NODE_TIMEOUT_S = 5.0
RELAUNCH_AFTER_S = 10.0
TORCHRUN_KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=5"
BOUND_S = NODE_TIMEOUT_S + 3.0  # issue 50 item 3
ARMS = {
    "standby": "ftlaunch, 3 + 1 standby",
    "relaunch": "ftlaunch, no standby (relaunch at +10 s)",
    "torchrun": "torchrun, 4 agents for 3 nodes",
}
PHASES = ["lost", "met", "spawn", "first step"]
WARM_TIMEOUT_S = 180.0  # start-up of 3-4 launchers importing torch on a busy 2-core machine
RECOVER_TIMEOUT_S = 120.0
END_TIMEOUT_S = 60.0
_STAMP = re.compile(
    r"(?P<what>\w+)\.rank_(?P<rank>\d+)\.group_(?P<group>\d+)\.pid_(?P<pid>\d+)\.node_(?P<node>\d+)$"
)


@dataclasses.dataclass
class Run:
    """One arm's run: ``total`` (kill → first step at full size) is None when it did not recover."""

    total: Optional[float] = None
    victim: Optional[int] = None  # the launcher killed
    phases: Dict[str, float] = dataclasses.field(default_factory=dict)
    rank2_node: Optional[int] = None  # which launcher ran rank 2 after the kill
    rank2_group: Optional[int] = None  # and the GROUP_RANK it had there
    codes: Dict[int, Optional[int]] = dataclasses.field(default_factory=dict)  # node → exit code
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Stamp:
    what: str
    rank: int
    group: int  # GROUP_RANK
    pid: int
    node: int  # the launcher (BENCH_NODE)
    t: float


def read_stamps(out: Path) -> List[Stamp]:
    found = []
    for path in out.iterdir():
        match = _STAMP.match(path.name)
        if match:
            rank, group, pid, node = (int(match[k]) for k in ("rank", "group", "pid", "node"))
            found.append(Stamp(match["what"], rank, group, pid, node, float(path.read_text())))
    return found


def full_size_after(stamps: List[Stamp], kill: float) -> Optional[Stamp]:
    """The first step at full size: for each rank, the earliest first step of a process started
    after the kill; the latest of those. None while a rank has none."""
    firsts = [first_after(stamps, kill, rank) for rank in range(NODES)]
    found = [s for s in firsts if s is not None]
    return max(found, key=lambda s: s.t) if len(found) == NODES else None


def first_after(stamps: List[Stamp], kill: float, rank: int) -> Optional[Stamp]:
    """``rank``'s first step in the first process that ran it after the kill."""
    after = [s for s in stamps if s.what == "first_step" and s.rank == rank and s.t > kill]
    return min(after, key=lambda s: s.t) if after else None


def until(look: Callable[[], T], timeout: float, every: float = 0.05) -> T:
    """``look()``'s first true answer, or its last one past ``timeout`` (monotonic)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = look()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(every)


def kill_tree_now(pid: int) -> Optional[float]:
    """SIGKILL ``pid`` and every descendant, found first; the kill's monotonic time (None: gone)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    killed_at = time.monotonic()
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)
    # Its orphan guard died with it: the memory tier's folder it would have removed goes too.
    for folder in Path("/dev/shm").glob(f"ftlaunch-memory-owned-{pid}-*"):
        shutil.rmtree(folder, ignore_errors=True)
    return killed_at


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Job:
    """One arm's launchers on loopback, each started with its node id and the run's marker."""

    def __init__(self, work: Path, marker: str) -> None:
        self.work, self.marker = work, marker
        self.out = work / "out"
        self.out.mkdir(parents=True)
        self.procs: Dict[int, subprocess.Popen] = {}
        self.launches = 0

    def start(self, node: int, command: List[str], env: Dict[str, str]) -> None:
        self.launches += 1
        log = open(self.work / f"node{node}.{self.launches}.log", "wb")
        with log:
            self.procs[node] = subprocess.Popen(
                command,
                env={**env, NODE_ENV: str(node), MARKER: self.marker},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl+C of the bench reaches the bench only
            )

    def early_exit(self) -> Optional[str]:
        """A launcher that ended before the bench's kill: the run is broken."""
        for node, proc in self.procs.items():
            if proc.poll() is not None:
                return f"node {node} exited {proc.returncode} before the kill"
        return None

    def wait_warm(self) -> Optional[str]:
        """None once every rank is past --warm-at, else why not."""
        warm = until(lambda: self.early_exit() or self._all_warm(), WARM_TIMEOUT_S)
        if warm is True:
            return None
        return warm if isinstance(warm, str) else f"not warm within {WARM_TIMEOUT_S:g} s"

    def _all_warm(self) -> bool:
        return {s.rank for s in read_stamps(self.out) if s.what == "warm"} == set(range(NODES))

    def warm_node_of(self, rank: int) -> int:
        return next(s.node for s in read_stamps(self.out) if s.what == "warm" and s.rank == rank)

    def end(self) -> Dict[int, Optional[int]]:
        """Ask the workers to stop (they agree on a step), then each launcher's exit code; one
        still running past the deadline is killed with its tree (code None)."""
        (self.out / "stop").touch()
        deadline = time.monotonic() + END_TIMEOUT_S
        codes: Dict[int, Optional[int]] = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree_now(proc.pid)
                proc.wait()
                codes[node] = None
        return codes

    def survivors(self) -> List[psutil.Process]:
        """Processes of this run still alive (the marker is in their environment)."""
        return marked_processes(MARKER, self.marker)

    def stop_all(self) -> int:
        """Kill, by pid, whatever of this run is left; how many there were."""
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_tree_now(proc.pid)
            proc.wait()
        left = [] if until(lambda: not self.survivors(), 10) else self.survivors()
        for proc in left:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        return len(left)


def ftlaunch_command(job: Job, node: int, nodes_total: int, endpoint: str) -> List[str]:
    standby = ["--standby-nodes", str(nodes_total - NODES)] if nodes_total > NODES else []
    return [
        sys.executable, "-m", "launcher",
        "--nnodes", str(NODES), *standby, "--node-rank", str(node), "--rdzv-endpoint", endpoint,
        "--nproc", "1", "--backend", "gloo", "--node-timeout", f"{NODE_TIMEOUT_S:g}s",
        "--max-failures", "3", "--run-name", "bench", "--run-dir", str(job.work / "runs"),
        "--log-dir", str(job.work / "logs"),
        str(WORKER), "--out", str(job.out),
    ]  # fmt: skip


def torchrun_command(job: Job, endpoint: str) -> List[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(NODES), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job.work.name,
        "--rdzv-conf", TORCHRUN_KEEP_ALIVE, "--max-restarts", "3",
        str(WORKER), "--out", str(job.out),
    ]  # fmt: skip


def run_arm(arm: str, work: Path, env: Dict[str, str]) -> Run:
    """One run of ``arm`` in ``work``; whatever it started is stopped by pid before it returns."""
    job = Job(work, uuid.uuid4().hex)
    try:
        return _run_arm(arm, job, env)
    finally:
        left = job.stop_all()
        if left:
            print(f"{arm}: {left} processes outlived the run; killed by pid", file=sys.stderr)


def _run_arm(arm: str, job: Job, env: Dict[str, str]) -> Run:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    why = _start(arm, job, endpoint, port, env) or job.wait_warm()
    if why:
        return Run(note=why, codes={n: p.poll() for n, p in job.procs.items()})
    victim = _torchrun_victim(job) if arm == "torchrun" else VICTIM
    killed_at = kill_tree_now(job.procs[victim].pid)
    if killed_at is None:
        return Run(note=f"node {victim} had exited before the kill")
    job.procs.pop(victim).wait()
    run = _recover(arm, job, victim, killed_at, endpoint, env)
    run.victim = victim
    return run


def _start(arm: str, job: Job, endpoint: str, port: int, env: Dict[str, str]) -> Optional[str]:
    """Start the arm's launchers; None, or why they could not start."""
    if arm == "torchrun":
        return _start_torchrun(job, endpoint, {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, port)
    total = NODES + 1 if arm == "standby" else NODES
    for node in range(total):
        job.start(node, ftlaunch_command(job, node, total, endpoint), env)
    return None


def _start_torchrun(job: Job, endpoint: str, env: Dict[str, str], port: int) -> Optional[str]:
    """Agent 0 first, so that it hosts the rendezvous store; then the other three."""
    job.start(0, torchrun_command(job, endpoint), env)
    listening = until(lambda: job.early_exit() or _listening(port), WARM_TIMEOUT_S)
    if listening is not True:
        return listening or f"torchrun's agent 0 did not listen within {WARM_TIMEOUT_S:g} s"
    for node in range(1, NODES + 1):
        job.start(node, torchrun_command(job, endpoint), env)
    return None


def _torchrun_victim(job: Job) -> int:
    """The participant with the highest GROUP_RANK (= RANK, one rank per node) but agent 0."""
    return next(job.warm_node_of(rank) for rank in reversed(range(NODES)) if job.warm_node_of(rank) != 0)


def _recover(arm: str, job: Job, victim: int, killed_at: float, endpoint: str, env: Dict[str, str]) -> Run:
    if arm == "relaunch":
        until(lambda: time.monotonic() >= killed_at + RELAUNCH_AFTER_S, RELAUNCH_AFTER_S + 1)
        job.start(victim, ftlaunch_command(job, victim, NODES, endpoint), env)
    done = until(lambda: full_size_after(read_stamps(job.out), killed_at), RECOVER_TIMEOUT_S)
    if not done:
        return Run(note=f"no first step at full size within {RECOVER_TIMEOUT_S:g} s", codes=job.end())
    rank2 = first_after(read_stamps(job.out), killed_at, 2) or done  # found: done says all are
    run = Run(total=done.t - killed_at, rank2_node=rank2.node, rank2_group=rank2.group, codes=job.end())
    if arm != "torchrun":
        run.phases = ftlaunch_phases(job.work / "logs", killed_at, done.t)
    return run


def ftlaunch_phases(logs: Path, killed_at: float, first: float) -> Dict[str, float]:
    """Phase by phase from the event logs: lost (kill → node 0's ``decision``), met (→ node 0's
    ``nodes_met`` of the new round), spawn (→ the last node of the new attempt RUNNING), first
    step (→ every rank's first step: the workers' stamps). A phase whose end is not logged ends
    the list."""
    node0 = read_jsonl(logs / "node0" / "events.jsonl")
    decided = _first_after(node0, killed_at, lambda e: e["event"] == "decision")
    met = _first_after(node0, killed_at, lambda e: e["event"] == "nodes_met")
    running = [
        _first_after(read_jsonl(path), met["t_mono"], lambda e: e.get("new") == "RUNNING")
        for path in logs.glob("node*/events.jsonl")
        if met is not None
    ]
    started = [e["t_mono"] for e in running if e is not None]
    ends = [e["t_mono"] if e else None for e in (decided, met)] + [max(started, default=None), first]
    phases: Dict[str, float] = {}
    begun = killed_at
    for name, end in zip(PHASES, ends):
        if end is None:
            break
        phases[name], begun = end - begun, end
    return phases


def _first_after(events: List[dict], since: float, match: Callable[[dict], bool]) -> Optional[dict]:
    return next((e for e in events if e["t_mono"] > since and match(e)), None)


def has_standby_option() -> bool:
    """True once ftlaunch takes --standby-nodes (issue 50 item 1)."""
    shown = subprocess.run(
        [sys.executable, "-m", "launcher", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return "--standby-nodes" in shown.stdout


def _cell(values: List[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def print_table(timed: Dict[str, List[Run]], skipped: Dict[str, str]) -> None:
    print(
        f"\nA training node's tree SIGKILLed ({NODES} nodes x 1 rank, DDP over gloo on loopback, "
        f"--node-timeout {NODE_TIMEOUT_S:g}s): kill → first step at full size (total) and "
        "ftlaunch's phases, seconds: median (min–max)\n"
    )
    print("| arm | " + " | ".join(PHASES) + " | total | recovered | rank 2 ran on after |")
    print("|---" * (len(PHASES) + 4) + "|")
    for arm, runs in timed.items():
        ok = [r for r in runs if r.total is not None]
        cells = [_cell([r.phases[p] for r in ok if p in r.phases]) for p in PHASES]
        where = ", ".join(sorted({f"node {r.rank2_node} (GROUP_RANK {r.rank2_group})" for r in ok})) or "—"
        total = _cell([r.total for r in ok if r.total is not None])
        print(f"| {ARMS[arm]} | " + " | ".join(cells) + f" | {total} | {len(ok)}/{len(runs)} | {where} |")
    for arm, why in skipped.items():
        print(f"| {ARMS[arm]} | " + " | ".join("—" for _ in PHASES) + f" | — | not run: {why} | — |")
    for arm, runs in timed.items():
        for i, r in enumerate(runs):
            if r.total is None or any(code != 0 for code in r.codes.values()):
                print(f"{ARMS[arm]}, run {i + 1}: {r.note or 'recovered'}; exit codes {r.codes}")
    print(bound_line(timed.get("standby"), skipped.get("standby", "the arm was not asked for")))


def bound_line(runs: Optional[List[Run]], why_not: str) -> str:
    """Issue 50 item 3's bound for the standby arm, said (not asserted)."""
    if runs is None:
        return f"Bound kill → full size ≤ --node-timeout + 3 s = {BOUND_S:g} s: not measured ({why_not})"
    totals = [r.total for r in runs if r.total is not None]
    within = sum(t <= BOUND_S for t in totals)
    verdict = "holds" if totals and within == len(runs) else "does NOT hold"
    worst = f"{max(totals):.2f} s" if totals else "none recovered"
    return (
        f"Bound kill → full size ≤ --node-timeout + 3 s = {BOUND_S:g} s: {verdict} "
        f"({within} of {len(runs)} runs within it; slowest {worst})"
    )


def bench_env(base: Mapping[str, str]) -> Dict[str, str]:
    """Every launcher's environment: gloo on loopback, output as it comes (the node logs)."""
    return {**base, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run of each arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)}")
    p.add_argument("--keep", type=Path, default=None, help="keep each run's logs and stamps here")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose among {', '.join(ARMS)}")
    repeats = 1 if args.quick else args.repeats
    skipped: Dict[str, str] = {}
    if "standby" in arms and not has_standby_option():
        arms.remove("standby")
        skipped["standby"] = "ftlaunch has no --standby-nodes yet"
    env = bench_env(os.environ)
    timed: Dict[str, List[Run]] = {arm: [] for arm in arms}
    work = args.keep or Path(tempfile.mkdtemp(prefix="ftlaunch-bench-standby-"))
    try:
        for i in range(repeats):  # interleaved, so every arm sees the same machine load
            for arm in arms:
                timed[arm].append(run_arm(arm, work / f"{arm}{i}", env))
            print(f"run {i + 1}/{repeats} done", file=sys.stderr)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(timed, skipped)


if __name__ == "__main__":
    main()
