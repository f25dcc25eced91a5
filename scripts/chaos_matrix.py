"""The reliability matrix: every fault ftlaunch claims to survive, injected many times into a real
training run, each run compared with one that had no fault.

    python scripts/chaos_matrix.py [--trials 10] [--seed N] [--faults kill,segv,...]

The subject is examples/train.py (DDP over gloo, 2 ranks, worker_lib checkpoints every 10 steps,
replicated) for --epochs epochs, with checkpoints on local disk. Per fault, each trial draws its
moment (a step, or how long into the run) from the seed; the table says per fault:

- landed: trials in which the fault happened (a rank failed of it, or the driver's action was
  done): a fault that lands nowhere proves nothing, and fails the trial;
- recovered: the run ended with exit 0 (after a relaunch, for the faults that need one);
- identical: its final committed checkpoint (model and optimizer) equals the fault-free run's, bit
  for bit;
- left: processes of the trial alive after it ended (supervisor, fork server, guard, workers);
- lost: committed checkpoints that no longer verify (a part missing, torn or changed), except the
  one a fault damaged on purpose;
- recovery: the fault → every rank of the new group has beaten (ftlaunch's events), median.

Faults injected from outside (a killed supervisor or guard, a damaged part, two supervisors) are
the driver's; the others go through ``ftlaunch --chaos`` (docs/reliability.md).
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker_lib.checkpoint import (  # noqa: E402
    REPLICATED,
    CheckpointManager,
    LocalChannel,
    committed_steps,
    step_dir,
)
from worker_lib.storage import Storage  # noqa: E402

MARKER = "FTLAUNCH_CHAOS_MATRIX_MARKER"
TRAIN = ROOT / "examples" / "train.py"
_TRIAL_TIMEOUT_S = 180.0


@dataclasses.dataclass
class Trial:
    """One run under one fault."""

    landed: bool = False  # the fault happened: a rank failed of it, or the driver's action was done
    recovered: bool = False
    identical: bool = False
    left: int = 0
    lost: int = 0
    recovery: Optional[float] = None  # seconds
    note: str = ""
    spared: Optional[int] = None  # a committed step the fault itself damaged (not counted as lost)


class Subject:
    """The training run a trial launches: its command, its run dir, its processes."""

    def __init__(self, work: Path, epochs: int, name: str) -> None:
        self.work = work / name
        self.marker = uuid.uuid4().hex
        self.epochs = epochs
        self.ckpt = self.work / "ckpt"
        self.launches = 0

    def command(self, *extra: str) -> List[str]:
        self.launches += 1
        return [
            sys.executable, "-m", "launcher", "--nproc", "2", "--run-dir", str(self.work / "runs"),
            "--run-name", "train", "--log-dir", str(self.work / f"logs_{self.launches}"),
            "--checkpoint-dir", str(self.ckpt), "--heartbeat-timeout", "3s", "--max-failures", "3",
            *extra, str(TRAIN), "--epochs", str(self.epochs), "--checkpoint-every", "10",
        ]  # fmt: skip

    def start(self, *extra: str) -> subprocess.Popen:
        env = {**os.environ, MARKER: self.marker, "PYTHONPATH": str(ROOT)}
        log = open(self.work / f"console_{self.launches + 1}.log", "w")
        with log:
            return subprocess.Popen(
                self.command(*extra),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def events(self, launch: int) -> List[dict]:
        path = self.work / f"logs_{launch}" / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def attempts(self) -> List[dict]:
        path = self.work / "runs" / "train" / "run.json"
        return json.loads(path.read_text())["attempts"] if path.exists() else []

    def processes(self) -> List[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get(MARKER) == self.marker and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def left_after(self, timeout: float = 10.0) -> int:
        """Processes of this subject still alive once up to ``timeout`` has passed; they are killed."""
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.processes()
        for proc in left:
            proc.kill()
        return len(left)

    def committed(self) -> List[int]:
        return [step for step, _ in committed_steps(Storage(str(self.ckpt)))] if self.ckpt.exists() else []

    def wait_for_commit(self, step: int, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if any(s >= step for s in self.committed()):
                return True
            time.sleep(0.05)
        return False


def wait(proc: subprocess.Popen, timeout: float = _TRIAL_TIMEOUT_S) -> Optional[int]:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def final_state(ckpt: Path) -> Optional[dict]:
    """The newest committed step's state (model, optimizer), as a rank would load it."""
    found = CheckpointManager(Storage(str(ckpt)), 0, 1, LocalChannel(), save_rng=False).load()
    return None if found is None else {"step": found.step, **found.state}


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def unreadable(ckpt: Path, spared: Optional[int] = None) -> int:
    """Committed steps that do not verify (``spared``: one damaged on purpose)."""
    manager = CheckpointManager(Storage(str(ckpt)), 0, 1, LocalChannel(), save_rng=False)
    bad = 0
    for step, marker in committed_steps(manager.storage):
        if step == spared:
            continue
        for name, expected in marker["parts"].items():
            if manager.read_verified(step, name, expected)[1]:
                bad += 1
                break
    return bad


def fault_time(events: List[dict]) -> Optional[float]:
    """When the first injected fault happened (monotonic): when it was sent, or, for one that
    waits in the slot for a save (at=save, at=commit), when the first failure after it came."""
    injected = [e for e in events if e["event"] == "chaos_injected"]
    if not injected:
        return None
    first = injected[0]
    if "at=save" not in first["fault"] and "at=commit" not in first["fault"]:
        return first["t_mono"]
    failed = [
        e["failed_at"]
        for e in events
        if e["event"] == "transition" and e.get("failed_at") and e["t_mono"] > first["t_mono"]
    ]
    return min(failed) if failed else None


def recovery_from(events: List[dict], fault_at: float) -> Optional[float]:
    """The fault (monotonic) → the first attempt after it in which every rank beat."""
    later = [e["t_mono"] for e in events if e["event"] == "first_step" and e["t_mono"] > fault_at]
    return min(later) - fault_at if later else None


# -- the faults ---------------------------------------------------------------------------------


def chaos_fault(spec: Callable[[random.Random, int], str]):
    """A fault ``ftlaunch --chaos`` injects; ``spec(rng, total_steps)`` writes its SPEC."""

    def trial(subject: Subject, rng: random.Random, steps: int) -> Trial:
        proc = subject.start("--chaos", spec(rng, steps))
        code = wait(proc)
        events = subject.events(1)
        landed = any(a.get("injected") for a in subject.attempts())  # a rank failed of it
        result = Trial(landed=landed, recovered=code == 0)
        happened = fault_time(events)
        if happened is not None:
            result.recovery = recovery_from(events, happened)
        return result

    return trial


def _step(rng: random.Random, steps: int) -> int:
    return rng.randrange(steps // 10, steps * 8 // 10)


def kill_supervisor(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """kill -9 of ftlaunch once a checkpoint past a random step is committed; the same command
    again resumes the run."""
    proc = subject.start()
    subject.wait_for_commit(_step(rng, steps), proc)
    killed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = subject.left_after()  # the orphan guard and PDEATHSIG take the workers with it
    code = wait(subject.start())
    recovery = recovery_from(subject.events(2), killed_at)
    return Trial(landed=True, recovered=code == 0, left=left, recovery=recovery)


def kill_guard(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """kill -9 of the orphan guard: the supervisor starts another; training goes on."""
    proc = subject.start()
    subject.wait_for_commit(_step(rng, steps), proc)
    guards = [p for p in subject.processes() if "launcher.process.orphan_guard" in " ".join(p.cmdline())]
    for guard in guards:
        guard.kill()
    code = wait(proc)
    restarted = any(e["event"] == "orphan_guard_restarted" for e in subject.events(1))
    note = "" if guards else "no guard found"
    return Trial(landed=bool(guards), recovered=code == 0 and restarted, note=note)


def damaged_part(how: str):
    """The supervisor is killed, the newest committed step's part is torn (cut in half) or has
    one bit flipped; the relaunch must fall back to the step before and end the same."""

    def trial(subject: Subject, rng: random.Random, steps: int) -> Trial:
        proc = subject.start()
        subject.wait_for_commit(_step(rng, steps), proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = subject.left_after()
        newest = max(subject.committed())
        part = subject.ckpt / step_dir(newest) / REPLICATED
        data = bytearray(part.read_bytes())
        if how == "torn":
            data = data[: len(data) // 2]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        part.write_bytes(bytes(data))
        code = wait(subject.start())
        return Trial(landed=True, recovered=code == 0, left=left, spared=newest)

    return trial


def two_supervisors(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """The same command started twice at once: one runs the job, the other refuses (exit 2)."""
    first, second = subject.start(), subject.start()
    codes = sorted([wait(first), wait(second)], key=lambda c: (c is None, c))
    return Trial(
        landed=True, recovered=codes == [0, 2], note="" if codes == [0, 2] else f"exit codes {codes}"
    )


def _at_step(kind: str):
    return chaos_fault(lambda r, n: f"{kind}:rank=random,at=step:{_step(r, n)};seed={r.getrandbits(31)}")


def _at_point(kind: str, point: str):
    return chaos_fault(lambda r, n: f"{kind}:rank=random,at={point};seed={r.getrandbits(31)}")


def _mixed(r: random.Random, n: int) -> str:
    first = _step(r, n) // 2
    return (
        f"kill:rank=random,at=step:{first};raise:rank=random,at=step:{first + n // 10};"
        f"hang:rank=random,at=step:{first + n // 5};kill:rank=random,at=save;seed={r.getrandbits(31)}"
    )


# id (for --faults) → (the table's words, the trial)
FAULTS: Dict[str, Tuple[str, Callable[[Subject, random.Random, int], Trial]]] = {
    "kill": ("SIGKILL of a random rank", _at_step("kill")),
    "segv": ("SIGSEGV of a random rank", _at_step("segv")),
    "raise": ("an exception in a random rank", _at_step("raise")),
    "stop": ("a hang: SIGSTOP of a random rank", _at_step("hang")),
    "sleep": ("a hang: a random rank sleeps", _at_step("sleep")),
    "save": ("a kill half-way through writing a part", _at_point("kill", "save")),
    "commit": ("a kill between a part and the commit", _at_point("kill", "commit")),
    "supervisor": ("kill -9 of ftlaunch, then the same command", kill_supervisor),
    "guard": ("kill -9 of the orphan guard", kill_guard),
    "torn": ("a torn part in the newest committed step", damaged_part("torn")),
    "bitflip": ("a flipped bit in the newest committed step", damaged_part("flipped")),
    "twice": ("two supervisors started at once", two_supervisors),
    "mixed": ("mixed: a kill, an exception, a hang, a kill in a save", chaos_fault(_mixed)),
}


def total_steps(epochs: int) -> int:
    per_epoch = (1797 * 8 // 10) // (32 * 2)  # examples/train.py: 80% of the digits, 32 per rank, 2 ranks
    return per_epoch * epochs


def reference_state(work: Path, epochs: int) -> dict:
    """The fault-free run's final committed state."""
    reference = Subject(work, epochs, "reference")
    reference.work.mkdir(parents=True)
    code = wait(reference.start())
    left = reference.left_after()
    if code != 0 or left:
        raise RuntimeError(f"the fault-free run failed (exit {code}, {left} left); see {reference.work}")
    return final_state(reference.ckpt)


def run_fault(
    fault: str, trials: int, seed: int, epochs: int, work: Path, expected: dict, say=print
) -> List[Trial]:
    """``fault`` injected ``trials`` times; the moments are drawn from ``seed``. A failed trial's
    directory is kept (and said), a passed one's removed."""
    name, inject = FAULTS[fault]
    rng = random.Random(f"{seed}/{fault}")
    results = []
    for number in range(trials):
        subject = Subject(work, epochs, f"{fault}_{number}")
        subject.work.mkdir(parents=True)
        trial = inject(subject, rng, total_steps(epochs))
        trial.left += subject.left_after()
        if trial.recovered:
            trial.identical = same(final_state(subject.ckpt), expected)
        trial.lost = unreadable(subject.ckpt, trial.spared)
        results.append(trial)
        if passed([trial]):
            shutil.rmtree(subject.work, ignore_errors=True)
        else:
            say(f"  {name}, trial {number + 1}: {trial} (kept: {subject.work})")
    return results


def passed(trials: List[Trial]) -> bool:
    return all(t.landed and t.recovered and t.identical and t.left == 0 and t.lost == 0 for t in trials)


def table(results: Dict[str, List[Trial]]) -> List[str]:
    lines = [
        "| fault | trials | landed | recovered | identical | left | lost | recovery (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, trials in results.items():
        n = len(trials)
        times = [t.recovery for t in trials if t.recovery is not None]
        recovery = f"{statistics.median(times):.2f} s" if times else "—"
        landed, recovered = sum(t.landed for t in trials), 100 * sum(t.recovered for t in trials) // n
        lines.append(
            f"| {name} | {n} | {landed} | {recovered}% | {100 * sum(t.identical for t in trials) // n}% | "
            f"{sum(t.left for t in trials)} | {sum(t.lost for t in trials)} | {recovery} |"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument("--epochs", type=int, default=6, help="of examples/train.py: 22 steps each")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"unknown fault(s) {unknown}; known: {','.join(FAULTS)}", file=sys.stderr)
        return 2
    print(f"chaos matrix: seed {seed}, {args.trials} trial(s) per fault, train.py --epochs {args.epochs}")
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-chaos-"))
    started = time.monotonic()
    expected = reference_state(work, args.epochs)
    results = {}
    for fault in faults:
        results[FAULTS[fault][0]] = trials = run_fault(fault, args.trials, seed, args.epochs, work, expected)
        print(f"{FAULTS[fault][0]}: {sum(passed([t]) for t in trials)}/{args.trials} passed", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')}, seed {seed}, {time.monotonic() - started:.0f} s\n")
    print("\n".join(table(results)))
    ok = all(passed(t) for t in results.values())
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nnot every row passed; failed trials are kept under {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
