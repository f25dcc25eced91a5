"""A health check's process: run in a process group of its own, its output appended to the node's
health log, killed with its whole group at its deadline or when a signal comes to ftlaunch."""

import dataclasses
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

import psutil

from launcher.forked.linux import die_with_parent
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.signals import NOTICE_SIGNALS
from launcher.process.waiting import Inbox, Wait

__all__ = ["CommandEnd", "run_check"]

TAIL_LINES = 5  # the output lines a failure shows
_MARK = "FTLAUNCH_HEALTH_CHECK_ID"  # in the check's environment, inherited by all it starts
_LINE_CHARS = 200  # of each


@dataclasses.dataclass(frozen=True)
class CommandEnd:
    """How a check's process ended: its exit status (None: killed at its deadline, or it could
    not start), its last lines of output, and how long it ran."""

    returncode: Optional[int]
    lines: List[str]  # its output's lines (its last 64 KiB), blank ones left out
    seconds: float
    error: str = ""  # it could not start: why

    @property
    def tail(self) -> List[str]:
        return self.lines[-TAIL_LINES:]

    @property
    def timed_out(self) -> bool:
        return self.returncode is None and not self.error

    def describe(self, timeout: float) -> str:
        if self.error:
            return self.error
        if self.timed_out:
            ended = f"no answer within {timeout:g} s (--health-check-timeout): killed, its process group too"
        elif self.returncode is not None and self.returncode < 0:
            ended = f"killed by {signal.Signals(-self.returncode).name}"
        else:
            ended = f"exit {self.returncode}"
        lines = " | ".join(self.tail)
        return f"{ended}; last output: {lines}" if lines else f"{ended}; no output"


def run_check(
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    timeout: float,
    signals: Inbox,
    guard: Optional[OrphanGuard] = None,
) -> CommandEnd:
    """Run ``argv`` to its end or its deadline. A signal that came before (any: a signal ends the
    run) or during it kills it and raises SignalReceived."""
    wait = Wait(timeout, signals, since=0)
    wait.check_signals()
    start = time.monotonic()
    mark = uuid.uuid4().hex
    with open(log, "ab") as out:
        offset = out.tell()
        try:
            proc = subprocess.Popen(
                list(argv),
                env={**env, _MARK: mark},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Dies with ftlaunch (the guard takes what it started); SLURM's notice is ftlaunch's.
                preexec_fn=die_with_parent(ignore=NOTICE_SIGNALS),
            )
        except OSError as err:
            return CommandEnd(None, [], 0.0, f"cannot start {argv[0]}: {err.strerror or err}")
    if guard is not None:
        guard.watch(proc.pid)  # a kill -9 of ftlaunch meanwhile: the guard kills what it started
    try:
        timed_out = _waited_out(proc, wait, mark)
    finally:
        _kill_group(proc, mark)  # what it started never outlives it, whatever its end
        if guard is not None:
            guard.forget(proc.pid)
    code = None if timed_out else proc.returncode
    return CommandEnd(code, _lines(log, offset), time.monotonic() - start)


def _waited_out(proc: "subprocess.Popen[bytes]", wait: Wait, mark: str) -> bool:
    """Until it exits (SIGCHLD wakes the inbox: False), or its deadline (killed: True); a signal
    raises SignalReceived (the caller kills it)."""
    while proc.poll() is None:
        if wait.expired:
            _kill_group(proc, mark)
            return True
        wait.pause()
    return False


def _kill_group(proc: "subprocess.Popen[bytes]", mark: str) -> None:
    """SIGKILL to the check's group and to every descendant found (one that made a session of its
    own too; once the check has exited, its orphans are the supervisor's, a subreaper, found by
    the mark in their environment), then reap them."""
    try:
        others = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        others = []
    others += [p for p in psutil.Process().children(recursive=True) if _marked(p, mark) and p not in others]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in others:
        try:
            child.kill()
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs(others, timeout=2.0)


def _marked(process: psutil.Process, mark: str) -> bool:
    try:
        return process.environ().get(_MARK) == mark
    except psutil.Error:
        return False


def _lines(log: Path, offset: int) -> List[str]:
    """The lines this check wrote to the log (read from where it began, 64 KiB at most)."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(offset, os.path.getsize(log) - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [line.strip()[:_LINE_CHARS] for line in text.splitlines() if line.strip()]
    return lines
