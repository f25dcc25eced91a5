"""Per-rank logs and console lines; DataLoader workers stopped with their rank."""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import ACTOR, SCRIPTS

from launcher.core.events import Transition
from launcher.process.tree import stop_tree

pytestmark = pytest.mark.exec_workers  # logs and children, not how the workers start


def test_console_lines_are_whole_and_prefixed(launcher):
    launch = launcher.run("--nproc", "3", str(ACTOR), "--spam", "3000", "--no-newline")
    assert launch.proc.returncode == 0, launch.stderr

    pattern = re.compile(r"^\[(\d)\] rank \1 (line \d+ x{200}|attempt 0 started|last words)$")
    lines = launch.stdout.splitlines()
    bad = [line for line in lines if not pattern.match(line)]
    assert bad == []
    for rank in range(3):
        assert sum(line.startswith(f"[{rank}] rank {rank} line ") for line in lines) == 3000
        assert f"[{rank}] rank {rank} last words" in lines  # a final line without its newline
        log = (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()
        assert log.count(f"rank {rank} line ") == 3000 and log.endswith(f"rank {rank} last words")


def progress_bar(rank: int, megabytes: int) -> bytes:
    """What the actor writes for --progress-mb."""
    update = f"\rrank {rank} progress ".encode()
    return b"".join(update + b"%09d|" % i for i in range(megabytes * 2**20 // (len(update) + 10)))


def test_progress_bars_reach_the_console_at_once_and_the_log_byte_for_byte(launcher, tmp_path):
    """tqdm-style output: "\\r…" updates and no newline. The console used to show nothing of it until
    a newline came (the workers here wait, mid-bar, until the console has shown both ranks' bars)."""
    go = tmp_path / "go"
    launch = launcher.start(
        "--nproc", "2", str(ACTOR), "--progress-mb", "4", "--go-file", str(go), "--run-for", "0"
    )
    seen = set()

    def both_ranks_shown(line: str) -> bool:
        found = re.match(r"\[(\d)\] rank \1 progress \d{9}\|", line)
        seen.update([found.group(1)] if found else [])
        return seen == {"0", "1"}

    launch.read_console_until(both_ranks_shown)
    go.touch()
    assert launch.wait() == 0, launch.stderr[-2000:]

    for rank in range(2):
        log = (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_bytes()
        assert log == progress_bar(rank, 4) + f"rank {rank} attempt 0 started\n".encode()  # byte for byte
    shown = [p for p in re.split(r"[\r\n]+", launch.stdout) if p]
    # The last update and the next print share a line: the worker wrote no line end between them.
    bar = re.compile(r"\[(\d)\] rank \1 progress \d{9}\|(rank \1 attempt 0 started)?")
    assert [p for p in shown if not bar.fullmatch(p)] == []
    assert sum(p.startswith("[1] rank 1 progress") for p in shown) == progress_bar(1, 4).count(b"\r")
    assert launch.survivors() == []


def test_console_ranks_filter_keeps_every_rank_in_its_file(launcher):
    launch = launcher.run("--nproc", "3", "--console-ranks", "1", str(ACTOR))
    assert launch.proc.returncode == 0, launch.stderr
    assert "[1] rank 1 attempt 0 started" in launch.stdout
    assert "[0]" not in launch.stdout and "[2]" not in launch.stdout
    for rank in range(3):
        assert "attempt 0 started" in (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()


def test_each_attempt_has_its_own_logs(launcher):
    launch = launcher.run("--nproc", "2", str(ACTOR), "--fail", "exit")
    assert launch.proc.returncode == 0, launch.stderr
    assert "about to fail" in (launch.log_dir / "attempt_0" / "rank_1.log").read_text()
    assert "about to fail" not in (launch.log_dir / "attempt_1" / "rank_1.log").read_text()


def test_dataloader_workers_are_stopped_with_their_rank(launcher, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    launch = launcher.run(
        "--nproc", "2", "--max-failures", "0", str(SCRIPTS / "dataloader.py"), env={"READY_DIR": str(ready)}
    )
    assert launch.proc.returncode == 1, launch.stderr
    assert "rank 1: loader workers up, dying" in launch.stdout
    assert len(list(ready.glob("rank_*.loader_*.pid"))) == 4  # 2 ranks x 2 loader processes
    assert launch.survivors() == []


def test_a_closed_console_does_not_stall_the_workers(launcher):
    # As in `ftlaunch ... | head`: the reader goes away, the workers keep running, files stay whole.
    launch = launcher.start("--nproc", "2", str(ACTOR), "--spam", "20000")
    launch.proc.stdout.close()
    assert launch.proc.wait(timeout=60) == 0
    for rank in range(2):
        log = (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()
        assert log.count(f"rank {rank} line ") == 20000
    assert launch.survivors() == []


def test_a_closed_stderr_does_not_stop_the_training_or_its_restarts(launcher):
    """`ftlaunch ... 2>&1 | head -2`: ftlaunch's own lines hit a closed pipe (EPIPE) from the third
    on. A failure then restarts the group as without the pipe, and the run ends as it should
    (before, the first write after the close raised, and the run was left RUNNING and unended)."""
    launch = launcher.start(
        "--nproc", "2", "--max-failures", "1", str(ACTOR), "--fail", "exit", "--fail-after", "1",
        "--run-for", "1",
    )  # fmt: skip
    launch.wait_for_event(Transition, lambda e: e.new == "RUNNING")
    launch.proc.stderr.close()  # the reader is gone: every later line of ftlaunch's fails
    assert launch.proc.wait(timeout=90) == 0
    transitions = [(e.attempt, e.new) for e in launch.events(Transition)]
    assert (0, "FAILED") in transitions and (1, "SUCCEEDED") in transitions
    assert launch.survivors() == []


def test_a_process_that_stops_itself_again_when_continued_is_stopped_by_sigterm():
    """A stopped worker gets SIGTERM before SIGCONT, so it is already pending when the process
    resumes: continued first, one that stops itself again (a chaos fault at a save, a loop of
    SIGSTOPs) was stopped anew before SIGTERM came and lived until the grace period ran out."""
    script = (
        "import os, signal\n"
        "signal.signal(signal.SIGCONT, lambda *_: os.kill(os.getpid(), signal.SIGSTOP))\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        "while True:\n"
        "    signal.pause()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        watched = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while watched.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watched.status() == psutil.STATUS_STOPPED
        # stop_tree signals every descendant of its caller: here, pytest's storage servers too
        others = {p.pid for p in psutil.Process().children(recursive=True) if p.pid != proc.pid}
        report = stop_tree(
            [proc.pid], signal.SIGTERM, grace=60, abort=lambda: False, exclude=lambda: others, reap=proc.poll
        )
        assert not report.killed and report.survivors == [] and proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
