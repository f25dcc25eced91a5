"""The reliability matrix: every fault ftlaunch claims to survive, injected many times into a real
training run, each run compared with one that had no fault.

    python scripts/chaos_matrix.py [--trials 10] [--seed N] [--setups state-local,...] [--faults kill,...]

The subject is examples/train.py (DDP over gloo, 2 ranks, worker_lib checkpoints every 10 steps)
for --epochs epochs, in each setup: saving its state (``ft.save_checkpoint``, replicated) or its
own files (``--save-as files``: directory mode), with checkpoints on local disk or on the GCS
emulator (fake-gcs-server on 127.0.0.1, driven through gcsfs). Per fault, each trial draws its
moment (a step, or how long into the run) from the seed; the table says per fault:

- landed: trials in which the fault happened (a rank failed of it, or the driver's action was
  done): a fault that lands nowhere proves nothing, and fails the trial;
- recovered: the run ended with exit 0 (after a relaunch, for the faults that need one);
- identical: its final committed checkpoint (model and optimizer) equals the fault-free run's, bit
  for bit (honest at 2 ranks only: at 3 a resumed DDP's first step may sum in another order,
  docs/reliability.md "What bit-identical means");
- left: processes of the trial alive after it ended (supervisor, fork server, guard, workers);
- lost: committed checkpoints that no longer verify (a part missing, torn or changed), except the
  one a fault damaged on purpose;
- recovery: the fault → every rank of the new group has beaten (ftlaunch's events), median.

Faults injected from outside (a killed supervisor or guard, a damaged part, two supervisors, a
storage outage, a full disk) are the driver's; the others go through ``ftlaunch --chaos``
(docs/reliability.md).
"""

import argparse
import dataclasses
import errno
import io
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
from typing import Callable, Dict, List, Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher.orphan_guard import GUARD_MODULE  # noqa: E402 - what the guard runs as
from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel  # noqa: E402
from worker_lib.checkpoint.marker import REPLICATED, committed_steps, read_verified, step_dir  # noqa: E402
from worker_lib.core.storage import Storage  # noqa: E402

MARKER = "FTLAUNCH_CHAOS_MATRIX_MARKER"


def marked_processes(variable: str, marker: str) -> List[psutil.Process]:
    """Live processes whose environment has ``variable`` = ``marker`` (a run's, whatever their parent)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(variable) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


TRAIN = ROOT / "examples" / "train.py"
_TRIAL_TIMEOUT_S = 180.0
_OUTAGE_S = 10.0
_TMPFS_SIZE = "16m"


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


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every trial of one matrix runs: how train.py saves, and where to."""

    save_as: str  # "state": ft.save_checkpoint; "files": its own files in ft.checkpoint_dir
    storage: str  # "local" | "gcs"

    @property
    def id(self) -> str:
        return f"{self.save_as}-{self.storage}"

    def describe(self) -> str:
        how = (
            "its state (ft.save_checkpoint)" if self.save_as == "state" else "its own files (directory mode)"
        )
        where = "local disk" if self.storage == "local" else "the GCS emulator"
        return f"examples/train.py saving {how} on {where}"


SETUPS = {
    s.id: s
    for s in (Setup("state", "local"), Setup("files", "local"), Setup("state", "gcs"), Setup("files", "gcs"))
}


class LocalDisk:
    """Checkpoints in each trial's own folder."""

    env: Dict[str, str] = {}

    def url(self, folder: Path) -> str:
        return str(folder / "ckpt")

    def storage(self, url: str) -> Storage:
        return Storage(url)

    def remove(self, url: str) -> None:
        pass  # inside the trial's folder

    def close(self) -> None:
        pass


class GcsEmulator:
    """fake-gcs-server on 127.0.0.1 (tests/storage_servers.py), one for all trials of a matrix,
    its objects kept on disk so that it can be stopped and started again on its port."""

    BUCKET = "chaos"

    def __init__(self, work: Path) -> None:
        # Before gcsfs is imported (workers inherit it): otherwise every write first waits 60 s
        # on a gRPC call that the emulator never answers (as in tests/conftest.py).
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        sys.path.insert(0, str(ROOT / "tests"))
        from storage_servers import start_gcs

        self._start = start_gcs
        self._folder = work / "gcs"
        self._folder.mkdir(parents=True)
        self.server, self.env = start_gcs(self._folder, keep_data=True)  # the workers' settings
        self._endpoint = self.env["FSSPEC_GCS_ENDPOINT_URL"]
        self.storage(f"gcs://{self.BUCKET}").fs.mkdir(self.BUCKET)

    def url(self, folder: Path) -> str:
        return f"gcs://{self.BUCKET}/{uuid.uuid4().hex}/ckpt"

    def storage(self, url: str) -> Storage:
        return Storage(url, token="anon", endpoint_url=self._endpoint)

    def remove(self, url: str) -> None:
        storage = self.storage(url)
        storage.fs.rm(storage.root, recursive=True)

    def outage(self, seconds: float) -> None:
        """Stopped (connections refused) for ``seconds``, then serving again what it held."""
        self.stop()
        time.sleep(seconds)  # the outage itself, not a wait for something
        self.start_again()

    def stop(self) -> None:
        self.server.stop()

    def start_again(self) -> None:
        """On its port, serving what it held."""
        port = int(self._endpoint.rsplit(":", 1)[1])
        self.server, _ = self._start(self._folder, port=port, keep_data=True)

    def close(self) -> None:
        self.server.stop()


class Subject:
    """The training run a trial launches: its command, its run dir, its checkpoints, its processes."""

    def __init__(self, work: Path, epochs: int, name: str, setup: Setup, place) -> None:
        self.work = work / name
        self.marker = uuid.uuid4().hex
        self.epochs = epochs
        self.setup = setup
        self.place = place
        self.ckpt = place.url(self.work)
        self.run_dir = str(self.work / "runs")  # a fault may move it (onto the emulator, a tmpfs)
        self.logs = self.work  # where each launch's logs_<n> folder goes
        self.launches = 0
        self.cleanups: List[Callable[[], None]] = []  # once the trial was judged

    def command(self, *extra: str) -> List[str]:
        self.launches += 1
        # 2 ranks: a sum of two is the same in either order, so a resumed run's new DDP sums its
        # first step as the fault-free run did (docs/reliability.md, "What bit-identical means").
        return [
            sys.executable, "-m", "launcher", "--nproc", "2", "--run-dir", self.run_dir,
            "--run-name", "train", "--log-dir", str(self.logs / f"logs_{self.launches}"),
            "--checkpoint-dir", self.ckpt, "--heartbeat-timeout", "3s", "--max-failures", "3",
            # A rank stopped inside a save (heartbeat paused) is judged against --init-timeout, 15
            # minutes by default: past the trial's limit. A hang drawn at a save step does that.
            "--init-timeout", "30s",
            # The example's one heavy import, imported once by the fork server instead of by every
            # rank of every attempt (2 s of CPU each here), as its docstring and the demo advise.
            "--preload", "sklearn.datasets",
            *extra, str(TRAIN), "--epochs", str(self.epochs), "--checkpoint-every", "10",
            "--save-as", self.setup.save_as,
        ]  # fmt: skip

    def storage(self) -> Storage:
        return self.place.storage(self.ckpt)

    def start(self, *extra: str) -> subprocess.Popen:
        env = {**os.environ, **self.place.env, MARKER: self.marker, "PYTHONPATH": str(ROOT)}
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
        return read_jsonl(self.logs / f"logs_{launch}" / "events.jsonl")

    def attempts(self) -> List[dict]:
        path = self.work / "runs" / "train" / "run.json"
        return json.loads(path.read_text())["attempts"] if path.exists() else []

    def processes(self) -> List[psutil.Process]:
        return marked_processes(MARKER, self.marker)

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
        return [marker.step for marker in committed_steps(self.storage())]

    def logged(self, text: str) -> bool:
        """Some worker of some launch wrote ``text`` to its log."""
        return any(
            text in log.read_text(errors="replace") for log in self.logs.glob("logs_*/attempt_*/rank_*.log")
        )

    def own_lines(self, launch: int) -> List[str]:
        """What ftlaunch itself wrote on the console in ``launch`` (1: the first): not its workers'
        lines (``[r] ...``), which may hold their own tracebacks (a rank whose storage died)."""
        text = (self.work / f"console_{launch}.log").read_text(errors="replace")
        return [
            line for line in text.splitlines() if not line.startswith("[") or line.startswith("[ftlaunch]")
        ]

    def wait_for_commit(
        self, step: int, proc: subprocess.Popen, timeout: float = 60.0, poll: float = 0.01
    ) -> bool:
        """Until a step at or past ``step`` is committed (True), or the run ended first. Looked at
        often: on a fast machine a step of train.py takes 5 ms, and the run may end 20 steps on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if any(s >= step for s in self.committed()):
                return True
            time.sleep(poll)
        return False


def wait(proc: subprocess.Popen, timeout: float = _TRIAL_TIMEOUT_S) -> Optional[int]:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def final_state(storage: Storage, save_as: str) -> Optional[dict]:
    """The newest committed step's state (step, model, optimizer), as a rank would load it."""
    import torch

    manager = CheckpointManager(storage, 0, 1, LocalChannel(), save_rng=False)
    if save_as == "state":
        found = manager.load()
        return None if found is None else {"step": found.step, **found.state}
    marker = next(committed_steps(storage), None)
    if marker is None:
        return None
    state = {}
    for name in ("step", "model", "optimizer"):
        part = f"files/{name}.pt"
        data, problem = read_verified(storage, marker.step, part, marker.parts.get(part))
        if problem:
            return None
        state[name] = torch.load(io.BytesIO(data))
    return state


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def unreadable(storage: Storage, spared: Optional[int] = None) -> int:
    """Committed steps that do not verify (``spared``: one damaged on purpose)."""
    bad = 0
    for marker in committed_steps(storage):
        if marker.step == spared:
            continue
        for name, expected in marker.parts.items():
            if read_verified(storage, marker.step, name, expected)[1]:
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
    """A step between 10% and 60% of the run. The supervisor sees a step on its next look (every
    50 ms, later while it is busy), and the 4-epoch run of make test has steps of 5 ms on a fast
    machine: a fault drawn at 80% was once seen at the run's last step, too late to land."""
    return rng.randrange(steps // 10, steps * 6 // 10)


def kill_supervisor(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """kill -9 of ftlaunch once a checkpoint past a random step is committed; the same command
    again resumes the run."""
    proc = subject.start()
    subject.wait_for_commit(_step(rng, steps), proc)
    killed_at, landed = time.monotonic(), proc.poll() is None  # not a run that had already ended
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = subject.left_after()  # the orphan guard and PDEATHSIG take the workers with it
    code = wait(subject.start())
    recovery = recovery_from(subject.events(2), killed_at)
    note = "" if landed else "the run ended before the kill"
    return Trial(landed=landed, recovered=code == 0, left=left, recovery=recovery, note=note)


def kill_guard(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """kill -9 of the orphan guard: the supervisor starts another; training goes on."""
    proc = subject.start()
    subject.wait_for_commit(_step(rng, steps), proc)
    guards = [p for p in subject.processes() if GUARD_MODULE in " ".join(p.cmdline())]
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
        landed = proc.poll() is None  # a run that had already ended would not load the part
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = subject.left_after()
        newest = max(subject.committed())
        part = f"{step_dir(newest)}/{REPLICATED if subject.setup.save_as == 'state' else 'files/model.pt'}"
        storage = subject.storage()
        data = bytearray(storage.read_bytes(part))
        if how == "torn":
            data = data[: len(data) // 2]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        storage.write_bytes(part, bytes(data))
        code = wait(subject.start())
        note = "" if landed else "the run ended before the kill"
        return Trial(landed=landed, recovered=code == 0, left=left, spared=newest, note=note)

    return trial


def storage_outage(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """The GCS emulator stops for 10 s right after a random step was committed. The next save is
    due 10 steps (well under a second) later: it meets the outage, and with it the save after it,
    which waits for the one before. Landed: the run was still going when the storage came back."""
    proc = subject.start()
    subject.wait_for_commit(_step(rng, steps), proc)
    subject.place.outage(_OUTAGE_S)
    landed = proc.poll() is None
    code = wait(proc)
    return Trial(
        landed=landed, recovered=code == 0, note="" if landed else "the run ended before the outage did"
    )


def full_disk(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """The checkpoint dir's filesystem (a small tmpfs) fills up right after a random step in the
    first half of the run was committed, and stays full until a save has failed of it for good
    (past worker_lib's retries: the group fails); then the space comes back, as once someone
    cleans up. The filler takes all but 2 MiB before the run starts, so that filling the rest
    takes no time: a run past its last save would prove nothing. It fills again whatever the run
    frees while it is held full: worker_lib removes older steps after each commit, and a step
    removed after the filler's first go would make room for the next save (a fast run's steps
    take a few milliseconds: found by CI)."""
    folder = Path(subject.ckpt)
    mount_tmpfs(folder, subject.cleanups)
    filler = folder / "filler"
    fill_up(filler, leave=2 << 20)
    proc = subject.start()
    subject.wait_for_commit(rng.randrange(steps // 10, steps // 2), proc)
    deadline = time.monotonic() + 60
    while _group_failed(subject.events(1)) is None and proc.poll() is None and time.monotonic() < deadline:
        fill_up(filler)
        time.sleep(0.005)
    failed = _group_failed(subject.events(1))
    landed = failed is not None and subject.logged("No space left on device")
    filler.unlink()
    code = wait(proc)
    result = Trial(
        landed=landed, recovered=code == 0, note="" if landed else "no group failed of the full disk"
    )
    if failed is not None:
        result.recovery = recovery_from(subject.events(1), failed)
    return result


def read_jsonl(path: Path) -> List[dict]:
    """A JSON-lines file that may be written to as it is read. A last line not yet ended may be
    the writer's next write, half seen (a read and an append interleave: found by CI as an
    unterminated string): skipped unless it parses, and the next read has it whole."""
    if not path.exists():
        return []
    *ended, last = path.read_text().split("\n")
    records = [json.loads(line) for line in ended if line.strip()]
    try:
        return records + [json.loads(last)] if last.strip() else records
    except ValueError:
        return records


def _group_failed(events: List[dict]) -> Optional[float]:
    """When the first group failure was seen (monotonic), if there was one."""
    return next((e["failed_at"] for e in events if e["event"] == "transition" and e["new"] == "FAILED"), None)


def mount_tmpfs(folder: Path, cleanups: List[Callable[[], None]]) -> None:
    if os.geteuid() != 0:
        raise RuntimeError("a full disk is a tmpfs of its own, and mounting one needs root")
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_TMPFS_SIZE}", "tmpfs", str(folder)], check=True)
    cleanups.append(lambda: subprocess.run(["umount", str(folder)], check=True))


def fill_up(filler: Path, leave: int = 0) -> None:
    """``filler`` grows until its filesystem has no more than ``leave`` bytes free."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        chunk = 1 << 20
        while chunk:
            if leave and shutil.disk_usage(filler.parent).free - chunk < leave:
                chunk //= 2
                continue
            try:
                os.write(fd, bytes(chunk))
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                chunk //= 2  # the last pages fill with smaller writes
    finally:
        os.close(fd)


def run_dir_death(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """The run dir (and the checkpoints) on the GCS emulator, which dies for good right after a
    random step was committed. ftlaunch must end the run once its lease (6 s here) has passed
    without an answer: exit 7, one line, the workers stopped, whatever the storage library's own
    retries (a minute and more). Once the emulator is back, the same command resumes the run.
    Landed: the run was going when storage died, and ended so."""
    subject.run_dir = f"gcs://{GcsEmulator.BUCKET}/{uuid.uuid4().hex}/runs"
    proc = subject.start("--lease", "6s")
    subject.wait_for_commit(_step(rng, steps), proc)
    going = proc.poll() is None
    subject.place.stop()
    code = wait(proc)
    left = subject.left_after()
    subject.place.start_again()
    own = subject.own_lines(1)
    errors = [line for line in own if line.startswith("ftlaunch: error:")]
    said = len(errors) == 1 and "has not answered for" in errors[0] and not any("Traceback" in o for o in own)
    landed = going and code == 7 and said
    again = wait(subject.start("--lease", "6s"))
    note = "" if landed else f"exit {code}, {errors or 'no error line'}" if going else "the run ended first"
    return Trial(landed=landed, recovered=again == 0, left=left, note=note)


def full_run_dir(subject: Subject, rng: random.Random, steps: int) -> Trial:
    """The run dir, and the logs in it, on a small tmpfs that fills up right after a random step
    was committed and stays full to the end: the training must not care (exit 0, the same final
    state), and ftlaunch says what it could not write. Landed: the run was going when the disk
    filled, and a write of ftlaunch's failed of it."""
    folder = subject.work / "runs"
    mount_tmpfs(folder, subject.cleanups)
    subject.run_dir, subject.logs = str(folder), folder
    proc = subject.start()
    subject.wait_for_commit(_step(rng, steps), proc)
    going = proc.poll() is None
    filler = folder / "filler"
    while proc.poll() is None:  # whatever is freed (a temporary file removed) is taken again
        fill_up(filler)
        time.sleep(0.05)
    code = wait(proc)
    own = "\n".join(subject.own_lines(1))
    failed = any(words in own for words in ("logs cut", "cannot write", "is not recorded"))
    landed = going and failed
    note = "" if landed else "no write failed" if going else "the run ended first"
    if "Traceback" in own:
        landed, note = False, "a traceback of ftlaunch's own"
    return Trial(landed=landed, recovered=code == 0, note=note)


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


@dataclasses.dataclass(frozen=True)
class Fault:
    words: str  # the table's
    trial: Callable[[Subject, random.Random, int], Trial]
    needs: Optional[str] = None  # "gcs": the GCS emulator; "tmpfs": local disk, and root to mount one

    def fits(self, setup: Setup) -> bool:
        return self.needs is None or (self.needs == "gcs") == (setup.storage == "gcs")


# id (for --faults) → the fault
FAULTS: Dict[str, Fault] = {
    "kill": Fault("SIGKILL of a random rank", _at_step("kill")),
    "segv": Fault("SIGSEGV of a random rank", _at_step("segv")),
    "raise": Fault("an exception in a random rank", _at_step("raise")),
    "stop": Fault("a hang: SIGSTOP of a random rank", _at_step("hang")),
    "sleep": Fault("a hang: a random rank sleeps", _at_step("sleep")),
    "save": Fault("a kill half-way through writing a part", _at_point("kill", "save")),
    "commit": Fault("a kill between a part and the commit", _at_point("kill", "commit")),
    "supervisor": Fault("kill -9 of ftlaunch, then the same command", kill_supervisor),
    "guard": Fault("kill -9 of the orphan guard", kill_guard),
    "outage": Fault("the GCS emulator stopped for 10 s during a save", storage_outage, needs="gcs"),
    "disk": Fault("a full disk under the checkpoint dir", full_disk, needs="tmpfs"),
    "rundir-death": Fault(
        "the run dir's storage dies for good (exit 7), then the same command", run_dir_death, needs="gcs"
    ),
    "rundir-disk": Fault("a full disk under the run dir and its logs", full_run_dir, needs="tmpfs"),
    "torn": Fault("a torn part in the newest committed step", damaged_part("torn")),
    "bitflip": Fault("a flipped bit in the newest committed step", damaged_part("flipped")),
    "twice": Fault("two supervisors started at once", two_supervisors),
    "mixed": Fault("mixed: a kill, an exception, a hang, a kill in a save", chaos_fault(_mixed)),
}


def total_steps(epochs: int) -> int:
    per_epoch = (1797 * 8 // 10) // (32 * 2)  # examples/train.py: 80% of the digits, 32 per rank, 2 ranks
    return per_epoch * epochs


class Matrix:
    """One setup's trials: its storage (started once), its fault-free run, its folder."""

    def __init__(self, setup: Setup, epochs: int, work: Path) -> None:
        self.setup = setup
        self.epochs = epochs
        self.work = work / setup.id
        self.place = None

    def __enter__(self) -> "Matrix":
        self.work.mkdir(parents=True)
        self.place = GcsEmulator(self.work) if self.setup.storage == "gcs" else LocalDisk()
        try:
            self.expected = self._reference_state()
        except BaseException:
            self.place.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.place.close()

    def faults(self) -> List[str]:
        return [fault for fault, f in FAULTS.items() if f.fits(self.setup)]

    def _reference_state(self) -> dict:
        """The fault-free run's final committed state."""
        reference = Subject(self.work, self.epochs, "reference", self.setup, self.place)
        reference.work.mkdir(parents=True)
        code = wait(reference.start())
        left = reference.left_after()
        state = final_state(reference.storage(), self.setup.save_as)
        if code != 0 or left or state is None:
            raise RuntimeError(f"the fault-free run failed (exit {code}, {left} left); see {reference.work}")
        return state

    def run_fault(self, fault: str, trials: int, seed: int, say=print) -> List[Trial]:
        """``fault`` injected ``trials`` times; the moments are drawn from ``seed``. A failed
        trial's folder is kept (and said), a passed one's removed."""
        rng = random.Random(f"{seed}/{fault}")
        results = []
        for number in range(trials):
            subject = Subject(self.work, self.epochs, f"{fault}_{number}", self.setup, self.place)
            subject.work.mkdir(parents=True)
            try:
                trial = FAULTS[fault].trial(subject, rng, total_steps(self.epochs))
                trial.left += subject.left_after()
                storage = subject.storage()
                if trial.recovered:
                    trial.identical = same(final_state(storage, self.setup.save_as), self.expected)
                trial.lost = unreadable(storage, trial.spared)
            finally:
                for cleanup in reversed(subject.cleanups):
                    cleanup()
            results.append(trial)
            if passed([trial]):
                self.place.remove(subject.ckpt)
                shutil.rmtree(subject.work, ignore_errors=True)
            else:
                say(f"  {FAULTS[fault].words}, trial {number + 1}: {trial} (kept: {subject.work})")
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


def _chosen(text: str, known: Dict[str, object], what: str) -> List[str]:
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {', '.join(unknown)}; known: {','.join(known)}")
    return chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument("--epochs", type=int, default=6, help="of examples/train.py: 22 steps each")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {','.join(SETUPS)}")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    setups = _chosen(args.setups, SETUPS, "setup")
    faults = _chosen(args.faults, FAULTS, "fault")
    print(f"chaos matrix: seed {seed}, {args.trials} trial(s) per fault, train.py --epochs {args.epochs}")
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-chaos-"))
    ok = True
    for setup in (SETUPS[s] for s in setups):
        started, results = time.monotonic(), {}
        print(f"\n## {setup.describe()}", flush=True)
        with Matrix(setup, args.epochs, work) as matrix:
            for fault in (f for f in faults if f in matrix.faults()):
                results[FAULTS[fault].words] = trials = matrix.run_fault(fault, args.trials, seed)
                print(
                    f"{FAULTS[fault].words}: {sum(passed([t]) for t in trials)}/{args.trials} passed",
                    flush=True,
                )
        took = time.monotonic() - started
        print(f"\n{time.strftime('%Y-%m-%d')}, seed {seed}, setup {setup.id}, {took:.0f} s\n")
        print("\n".join(table(results)), flush=True)
        ok = ok and all(passed(t) for t in results.values())
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nnot every row passed; failed trials are kept under {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
