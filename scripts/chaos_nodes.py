"""The reliability matrix on many nodes: a node's supervisor killed or stopped at any moment of the
protocol, on loopback, while every rank is in real DDP collectives; with a standby node (``3+1``:
3 train, 1 stands by), a training node lost for good or bad in every attempt (--chaos kill-node,
bad-node), whose place the standby takes.

    python scripts/chaos_nodes.py [--trials 10] [--seed N] [--nodes 2,3,3+1] [--faults follower-kill,...]

The subject is tests/scripts/ddp_plain.py (no worker_lib: what a torchrun user brings), one rank
per node, each step a real all-reduce over gloo, its own torch.save checkpoint every 10 steps;
one ftlaunch per node, --node-timeout 3 s. Each trial draws its moment from the seed: anywhere
from the launch (the nodes still meeting) to well into the training. A trial passes when every
node exits 0 (after the relaunch the fault calls for), the final weights equal a fault-free run's
bit for bit, and no process is left. A trial that does not end within its time is stopped with
SIGTERM, and the table says whether every node answered it (``deaf``: one did not). A standby
fault's trial relaunches nothing: it passes when the named node ends as the fault has it (-9, lost;
8, excluded), every other node exits 0 and the last attempt ran at full size with the standby in
the named node's place (``replaced``).
"""

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import psutil
from chaos_matrix import _chosen, marked_processes  # the one-node matrix's --faults parsing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from launcher.core import failpoints  # noqa: E402 - the names of the meeting's moments
from launcher.forked.protocol import ZYGOTE_MODULE  # noqa: E402 - what the zygote runs as
from launcher.runs.directory import RunDir  # noqa: E402 - run.json, as ftlaunch reads it

DDP = ROOT / "tests" / "scripts" / "ddp_plain.py"
MARKER = "FTLAUNCH_CHAOS_NODES_MARKER"
NODE_TIMEOUT_S = 3.0
STEPS = 300  # 0.03 s each: about 10 s of training after 3-4 s of start-up
_TRIAL_TIMEOUT_S = 240.0
_ANSWER_S = 30.0  # how long a node may take to end on SIGTERM


@dataclasses.dataclass
class Trial:
    landed: bool = False  # the fault was delivered while the job ran
    recovered: bool = False  # every node exited 0
    identical: bool = False  # the final weights equal the fault-free run's
    left: int = 0  # processes of the trial alive after it
    deaf: int = 0  # nodes that did not end on SIGTERM (only asked when the trial did not end)
    replaced: Optional[bool] = None  # a standby fault's: the standby finished in the node's place
    note: str = ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NodeJob:
    """One job: ``nnodes`` training ftlaunch processes and ``standby`` more on loopback, each in a
    session of its own."""

    def __init__(self, work: Path, nnodes: int, standby: int = 0) -> None:
        self.work, self.nnodes, self.standby = work, nnodes, standby
        self.work.mkdir(parents=True)
        self.endpoint = f"127.0.0.1:{_free_port()}"
        self.marker = uuid.uuid4().hex
        self.procs: Dict[int, subprocess.Popen] = {}
        self.logs: Dict[int, Path] = {}  # node → its last launch's console
        self.log_dirs: Dict[int, Path] = {}  # node → its last launch's --log-dir
        self.launches = 0
        self.armed: Dict[int, str] = {}  # node → the failpoint its first launch freezes at
        self.chaos = ""  # --chaos on every node (a standby fault's)
        self.expected: Dict[int, int] = {}  # node → its exit code when not 0 (a standby fault's)

    @property
    def members(self) -> int:
        return self.nnodes + self.standby

    @property
    def run_dir(self) -> Path:
        return self.work / "runs" / "job"

    @property
    def out(self) -> Path:
        return self.work / "out.pt"

    def start(self, node: int) -> subprocess.Popen:
        self.launches += 1
        self.log_dirs[node] = self.work / f"logs_{self.launches}"
        ours = ["--standby-nodes", str(self.standby)] if self.standby else []
        ours += ["--chaos", self.chaos] if self.chaos else []
        argv = [
            sys.executable, "-m", "launcher", "--nproc", "1", "--nnodes", str(self.nnodes), *ours,
            "--node-rank", str(node), "--rdzv-endpoint", self.endpoint,
            "--node-timeout", f"{NODE_TIMEOUT_S:g}s", "--max-failures", "10",
            "--run-dir", str(self.work / "runs"), "--run-name", "job",
            "--log-dir", str(self.log_dirs[node]),
            str(DDP), "--steps", str(STEPS), "--step-time", "0.03", "--ckpt", str(self.work / "own.ckpt"),
            "--out", str(self.out),
        ]  # fmt: skip
        env = {**os.environ, MARKER: self.marker, "PYTHONPATH": str(ROOT)}
        if node in self.armed and self.launches <= self.members:  # only the node's first launch
            env["FTLAUNCH_FAILPOINT"] = self.armed[node]
        self.logs[node] = self.work / f"node{node}_{self.launches}.log"
        with open(self.logs[node], "w") as log:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[node] = proc
        return proc

    def start_all(self) -> "NodeJob":
        if not self.standby:
            for node in range(self.nnodes):
                self.start(node)
            return self
        # The lowest node ranks train only when every node joins node 0's first round: the
        # followers first, each until it waits for node 0 (a late one would stand by instead).
        for node in range(1, self.members):
            self.start(node)
        deadline = time.monotonic() + _TRIAL_TIMEOUT_S / 2
        for node in range(1, self.members):
            while "waiting for node 0 at" not in self.logs[node].read_text(errors="replace"):
                if time.monotonic() > deadline or self.procs[node].poll() is not None:
                    raise RuntimeError(f"node {node} never waited for node 0; see {self.logs[node]}")
                time.sleep(0.05)
        self.start(0)
        return self

    def events(self, node: int, kind: str) -> List[dict]:
        """``kind`` events of ``node``'s last launch (its events.jsonl)."""
        path = self.log_dirs[node] / f"node{node}" / "events.jsonl"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [e for e in map(_json_or_none, lines) if e is not None and e.get("event") == kind]

    def wait(self, deadline: float) -> Dict[int, Optional[int]]:
        """Each node's exit code; None for one still running at ``deadline`` (monotonic)."""
        codes = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[node] = None
        return codes

    def stop_the_rest(self) -> int:
        """SIGTERM to every node still running; the number of nodes that did not end within
        ``_ANSWER_S`` (those are killed)."""
        running = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in running:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped one acts on SIGTERM only once continued
            proc.send_signal(signal.SIGTERM)
        deaf = 0
        for proc in running:
            try:
                proc.wait(_ANSWER_S)
            except subprocess.TimeoutExpired:
                deaf += 1
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return deaf

    def worker_of(self, node: int) -> Optional[psutil.Process]:
        """The rank process under ``node``'s supervisor, once there is one: a forked worker shows
        the script's command line too (the fork server itself shows its own)."""
        try:
            for child in psutil.Process(self.procs[node].pid).children(recursive=True):
                cmdline = " ".join(child.cmdline())
                if str(DDP) in cmdline and ZYGOTE_MODULE not in cmdline:
                    return child
        except psutil.Error:
            return None
        return None

    def left_after(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while self._processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self._processes()
        for proc in left:
            proc.kill()
        return len(left)

    def _processes(self) -> List[psutil.Process]:
        return marked_processes(MARKER, self.marker)


def _json_or_none(line: str) -> Optional[dict]:
    try:
        return json.loads(line)
    except ValueError:  # a line cut by the kill
        return None


# -- the faults: each acts on a running job and says whether it landed ----------------------------


def _moment(rng: random.Random) -> float:
    """Seconds after the launch: from the nodes' meeting (the first 2-4 s) well into the training."""
    return rng.uniform(0.0, 9.0)


def _kill_supervisor(
    node_of: Callable[[NodeJob, random.Random], int], relaunch_after: Callable[[random.Random], float]
):
    def fault(job: NodeJob, rng: random.Random) -> Trial:
        node = node_of(job, rng)
        time.sleep(_moment(rng))
        proc = job.procs[node]
        landed = proc.poll() is None
        if landed:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(relaunch_after(rng))
        job.start(node)
        return Trial(landed=landed, note="" if landed else "the node had ended before the kill")

    return fault


def _stop_supervisor(low: float, high: float, node: Optional[int] = None):
    """SIGSTOP of a node's supervisor (``node``, or one drawn from the seed) for ``low``..``high``
    x --node-timeout, then SIGCONT."""

    def fault(job: NodeJob, rng: random.Random) -> Trial:
        node_drawn = rng.randrange(job.nnodes)
        stopped = node_drawn if node is None else node
        time.sleep(_moment(rng))
        proc = job.procs[stopped]
        landed = proc.poll() is None
        if landed:
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(low, high) * NODE_TIMEOUT_S)
            os.kill(proc.pid, signal.SIGCONT)
        return Trial(landed=landed, note="" if landed else "the node had ended before the stop")

    return fault


def _kill_while_meeting(relaunch_after: Callable[[random.Random], float]):
    """kill -9 of a follower's supervisor at a moment of the nodes' meeting (drawn from the seed:
    before it joins a round, after it joined one, after it announced itself), where a failpoint
    froze it; relaunched at once or late. A fixed-size job must never start without it."""

    def fault(job: NodeJob, rng: random.Random) -> Trial:
        (node,) = job.armed
        proc, deadline = psutil.Process(job.procs[node].pid), time.monotonic() + 120.0
        while proc.status() != psutil.STATUS_STOPPED:
            if time.monotonic() > deadline or job.procs[node].poll() is not None:
                return Trial(note=f"node {node} never reached failpoint {job.armed[node]}")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        job.procs[node].wait()
        time.sleep(relaunch_after(rng))
        job.start(node)
        return Trial(landed=True)

    return fault


def _arm_a_follower(job: NodeJob, rng: random.Random) -> None:
    job.armed = {rng.randrange(1, job.nnodes): rng.choice(failpoints.MEETING)}


def _kill_worker(job: NodeJob, rng: random.Random) -> Trial:
    """kill -9 of the rank on a follower, once it runs (the nodes' start, each importing torch, took
    more than 30 s on a loaded machine: the trial's own limit bounds this wait)."""
    node = rng.randrange(1, job.nnodes)
    time.sleep(_moment(rng))
    deadline = time.monotonic() + _TRIAL_TIMEOUT_S / 2
    while time.monotonic() < deadline:
        worker = job.worker_of(node)
        if worker is not None:
            try:
                worker.kill()
                return Trial(landed=True)
            except psutil.Error:
                pass
        time.sleep(0.05)
    return Trial(note="no worker of the follower was found to kill")


def _follower(job: NodeJob, rng: random.Random) -> int:
    return rng.randrange(1, job.nnodes)


def _leader(job: NodeJob, rng: random.Random) -> int:
    return 0


def _at_once(rng: random.Random) -> float:
    return 0.0


def _late(rng: random.Random) -> float:
    return rng.uniform(2.0, 4.0) * NODE_TIMEOUT_S  # long after the others found it lost


# -- with a standby: faults --chaos injects (the job's own, nothing from outside) ----------------


def _node_chaos(kind: str, moment: Callable[[random.Random], str], code: int):
    """``--chaos kind:node=R,at=...`` on every node, R a training follower drawn from the seed;
    node R is to end with ``code``."""

    def arm(job: NodeJob, rng: random.Random) -> None:
        node = rng.randrange(1, job.nnodes)
        job.chaos, job.expected = f"{kind}:node={node},at={moment(rng)}", {node: code}

    return arm


def _lost_at(rng: random.Random) -> str:
    return f"{_moment(rng):.2f}s"  # from ftlaunch's start: while the nodes meet, it comes at the first step


def _bad_after(rng: random.Random) -> str:
    return f"{rng.uniform(0.5, 6.0):.2f}s"  # after each attempt's start: before or in the training


def _nothing_from_outside(job: NodeJob, rng: random.Random) -> Trial:
    return Trial()


def _judge_standby(job: NodeJob, trial: Trial) -> None:
    """The fault landed on the named node (kill-node once, bad-node in the two attempts that
    exclude it) and the job ended at full size with the standby in that node's place."""
    ((named, _),) = job.expected.items()
    sent = job.events(named, "chaos_injected")
    trial.landed = len(sent) == (1 if job.chaos.startswith("kill-node") else 2)
    state = RunDir(str(job.run_dir)).read_state()
    last = state.attempts[-1].nodes if state is not None and state.attempts else []
    positions = {n["node"]: n.get("position") for n in last if n.get("position") is not None}
    trial.replaced = len(positions) == job.nnodes and positions.get(job.nnodes) == named  # lowest train
    if job.launches != job.members:
        trial.replaced, trial.note = False, f"{job.launches - job.members} node(s) relaunched"
    elif not trial.replaced:
        trial.note = f"the last attempt's positions: {positions}"


@dataclasses.dataclass(frozen=True)
class Fault:
    words: str
    trial: Callable[[NodeJob, random.Random], Trial]
    arm: Optional[Callable[[NodeJob, random.Random], None]] = None  # before the nodes start
    standby: bool = False  # a job with a standby node's fault (only those run at N+K)


FAULTS = {
    "follower-kill": Fault(
        "a follower's supervisor kill -9, relaunched at once", _kill_supervisor(_follower, _at_once)
    ),
    "follower-kill-late": Fault(
        "a follower's supervisor kill -9, relaunched late", _kill_supervisor(_follower, _late)
    ),
    "leader-kill": Fault(
        "node 0's supervisor kill -9, relaunched at once", _kill_supervisor(_leader, _at_once)
    ),
    "leader-kill-late": Fault(
        "node 0's supervisor kill -9, relaunched late", _kill_supervisor(_leader, _late)
    ),
    "stop-short": Fault("a supervisor stopped for less than --node-timeout", _stop_supervisor(0.2, 0.6)),
    "stop-long": Fault("a supervisor stopped for more than --node-timeout", _stop_supervisor(1.5, 3.0)),
    "leader-stop-short": Fault(
        "node 0's supervisor stopped for less than --node-timeout", _stop_supervisor(0.2, 0.6, node=0)
    ),
    "leader-stop-long": Fault(
        "node 0's supervisor stopped for more than --node-timeout", _stop_supervisor(1.5, 3.0, node=0)
    ),
    "worker-kill": Fault("a follower's worker kill -9", _kill_worker),
    "meeting-kill": Fault(
        "a follower's supervisor kill -9 while the nodes meet, relaunched at once",
        _kill_while_meeting(_at_once),
        _arm_a_follower,
    ),
    "meeting-kill-late": Fault(
        "a follower's supervisor kill -9 while the nodes meet, relaunched late",
        _kill_while_meeting(_late),
        _arm_a_follower,
    ),
    "node-lost": Fault(
        "a training node lost for good (--chaos kill-node), the standby in its place",
        _nothing_from_outside,
        _node_chaos("kill-node", _lost_at, -signal.SIGKILL),
        standby=True,
    ),
    "bad-node": Fault(
        "a training node whose rank dies in every attempt (--chaos bad-node), excluded",
        _nothing_from_outside,
        _node_chaos("bad-node", _bad_after, 8),
        standby=True,
    ),
}


class Matrix:
    """The trials of one job size (``standby`` nodes beyond ``nnodes``): its fault-free run, its folder."""

    def __init__(self, nnodes: int, work: Path, standby: int = 0) -> None:
        self.nnodes, self.standby = nnodes, standby
        self.work = work / f"{size_name(nnodes, standby)}-nodes"

    def __enter__(self) -> "Matrix":
        import torch

        reference = NodeJob(self.work / "reference", self.nnodes, self.standby).start_all()
        codes = reference.wait(time.monotonic() + _TRIAL_TIMEOUT_S)
        deaf = reference.stop_the_rest()
        left = reference.left_after()
        if any(code != 0 for code in codes.values()) or left or deaf or not reference.out.exists():
            raise RuntimeError(
                f"the fault-free run failed (exit codes {codes}, {left} left); see {reference.work}"
            )
        self.expected = torch.load(reference.out)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run_fault(self, fault: str, trials: int, seed: int, say=print) -> List[Trial]:
        import torch

        rng = random.Random(f"{seed}/{size_name(self.nnodes, self.standby)}/{fault}")
        results = []
        for number in range(trials):
            job = NodeJob(self.work / f"{fault}_{number}", self.nnodes, self.standby)
            if FAULTS[fault].arm is not None:
                FAULTS[fault].arm(job, rng)
            job.start_all()
            try:
                trial = FAULTS[fault].trial(job, rng)
                codes = job.wait(time.monotonic() + _TRIAL_TIMEOUT_S)
                trial.recovered = all(code == job.expected.get(node, 0) for node, code in codes.items())
                if None in codes.values():
                    trial.note = (
                        trial.note + "; " if trial.note else ""
                    ) + f"still running after {_TRIAL_TIMEOUT_S:g} s"
            finally:
                trial.deaf = job.stop_the_rest()
                trial.left = job.left_after()
            if FAULTS[fault].standby:
                _judge_standby(job, trial)
            if trial.recovered and job.out.exists():
                got = torch.load(job.out)
                trial.identical = same_weights(got, self.expected)
                if not trial.identical:
                    trial.note = "; ".join(filter(None, [trial.note, _unlike(job, got, self.expected)]))
            if trial.recovered and not trial.note:
                trial.note = f"exit codes {codes}" if not trial.identical else ""
            results.append(trial)
            if passed([trial]):
                shutil.rmtree(job.work, ignore_errors=True)
            else:
                say(f"  {FAULTS[fault].words}, trial {number + 1}: {trial} (kept: {job.work})")
        return results


def same_weights(got: dict, expected: dict) -> bool:
    """Bit for bit: ddp_plain.py resumes exactly under torchrun too (it starts a new DDP at each
    save, as a resumed run does), so a difference is the run's, not torch's summation order."""
    import torch

    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def _unlike(job: NodeJob, got: dict, expected: dict) -> str:
    """What a reader needs to judge a difference: how large, and where the attempts started."""
    if got.keys() != expected.keys() or any(got[k].shape != expected[k].shape for k in got):
        return "the final weights are not the fault-free run's tensors"
    largest = max((got[k].double() - expected[k].double()).abs().max().item() for k in got)
    starts = sorted({int(s) for s in re.findall(r"starts at step (\d+)", _logs(job))})
    return f"the final weights differ by up to {largest:.2g}; attempts started at steps {starts}"


def _logs(job: NodeJob) -> str:
    return "".join(log.read_text(errors="replace") for log in sorted(job.work.glob("node*.log")))


def passed(trials: List[Trial]) -> bool:
    return all(
        t.landed and t.recovered and t.identical and t.replaced is not False and t.left == 0 and t.deaf == 0
        for t in trials
    )


def table(results: Dict[str, List[Trial]]) -> List[str]:
    """``replaced`` only where a standby takes a place (``-`` elsewhere)."""
    lines = [
        "| fault | trials | landed | recovered | identical | replaced | left | deaf |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, trials in results.items():
        n = len(trials)
        recovered, identical = (
            100 * sum(getattr(t, k) for t in trials) // n for k in ("recovered", "identical")
        )
        judged = [t.replaced for t in trials if t.replaced is not None]
        replaced = f"{100 * sum(judged) // len(judged)}%" if judged else "-"
        lines.append(
            f"| {name} | {n} | {sum(t.landed for t in trials)} | {recovered}% | {identical}% | {replaced} | "
            f"{sum(t.left for t in trials)} | {sum(t.deaf for t in trials)} |"
        )
    return lines


def size_name(nnodes: int, standby: int) -> str:
    return f"{nnodes}+{standby}" if standby else str(nnodes)


def parse_sizes(text: str) -> List[Tuple[int, int]]:
    """``2,3,3+1`` → [(2, 0), (3, 0), (3, 1)]: training nodes and standby nodes."""
    sizes = []
    for size in filter(None, (s.strip() for s in text.split(","))):
        nnodes, _, standby = size.partition("+")
        sizes.append((int(nnodes), int(standby or 0)))
    return sizes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument("--nodes", default="2,3,3+1", help="job sizes, comma-separated; N+K: K standby nodes")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    faults = _chosen(args.faults, FAULTS, "fault")
    trials = f"{args.trials} trial(s) per fault"
    print(f"chaos matrix on many nodes: seed {seed}, {trials}, ddp_plain.py --steps {STEPS}")
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-chaos-nodes-"))
    ok = True
    for nnodes, standby in parse_sizes(args.nodes):
        started, results, name = time.monotonic(), {}, size_name(nnodes, standby)
        these = [f for f in faults if FAULTS[f].standby == bool(standby)]
        if not these:
            continue
        print(f"\n## {name} nodes x 1 rank, tests/scripts/ddp_plain.py on loopback", flush=True)
        with Matrix(nnodes, work, standby) as matrix:
            for fault in these:
                results[FAULTS[fault].words] = trials = matrix.run_fault(fault, args.trials, seed)
                print(
                    f"{FAULTS[fault].words}: {sum(passed([t]) for t in trials)}/{args.trials} passed",
                    flush=True,
                )
        took = time.monotonic() - started
        print(f"\n{time.strftime('%Y-%m-%d')}, seed {seed}, {name} nodes, {took:.0f} s\n")
        print("\n".join(table(results)), flush=True)
        ok = ok and all(passed(t) for t in results.values())
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nnot every row passed; failed trials are kept under {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
