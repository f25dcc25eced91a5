"""Run ftlaunch for real, watch what it started, and find what outlived it."""

import contextlib
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Type, TypeVar, Union

import psutil

from launcher.core.events import Logged, parse_logged
from launcher.core.records import RunState
from launcher.runs.directory import RunDir

E = TypeVar("E")  # an event record type of launcher.core.events
ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ACTOR = SCRIPTS / "actor.py"
MARKER = "FTLAUNCH_TEST_MARKER"  # set in the supervisor's env, inherited by all it starts


def processes_with_marker(marker: str) -> List[psutil.Process]:
    """Live (non-zombie) processes whose environment carries this test's marker."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@dataclasses.dataclass
class Launch:
    proc: subprocess.Popen
    log_dir: Path
    marker: str
    stdout: str = ""
    stderr: str = ""
    _read_early: dict = dataclasses.field(default_factory=dict)  # stream → lines read while it ran
    _readers: dict = dataclasses.field(default_factory=dict)  # stream → (the thread, its queue)

    def wait(self, timeout: float = 90) -> int:
        for name, (thread, lines) in self._readers.items():  # each reads its stream to EOF
            thread.join(timeout)
            while not lines.empty():
                self._read_early.setdefault(name, []).append(lines.get())
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"ftlaunch did not finish in {timeout}s:\n{out}\n{err}") from None
        self.stdout = "".join(self._read_early.get("stdout", [])) + (out or "")
        self.stderr = "".join(self._read_early.get("stderr", [])) + (err or "")
        return self.proc.returncode

    def read_console_until(self, match: Callable[[str], bool], timeout: float = 30.0, stream="stdout") -> str:
        """Read ftlaunch's ``stream`` while it runs, line by line (a carriage return ends a line
        too), until ``match`` accepts one; bounded. What was read still ends up in ``stdout`` or
        ``stderr``."""
        if stream not in self._readers:
            lines: queue.Queue[str] = queue.Queue()
            handle = getattr(self.proc, stream)

            def reader() -> None:  # to EOF: communicate() would bypass what this file object buffered
                while True:
                    line = handle.readline()
                    lines.put(line)
                    if not line:
                        return

            thread = threading.Thread(target=reader, daemon=True)
            thread.start()
            self._readers[stream] = (thread, lines)
        lines = self._readers[stream][1]
        early = self._read_early.setdefault(stream, [])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            early.append(line)
            if line and match(line):
                return line
            if not line:
                lines.put(line)  # EOF stays visible to a later call
                break
        raise AssertionError(f"no matching {stream} line after {timeout}s:\n{''.join(early)[-2000:]}")

    def logged(self, kind: Type[E]) -> List[Logged]:
        """This node's events of ``kind`` (an event record type of launcher.core.events), with their
        times, read back by ftlaunch's own reader."""
        return [found for found in read_logged(self.log_dir / "events.jsonl") if type(found.event) is kind]

    def events(self, kind: Type[E]) -> List[E]:
        return [found.event for found in self.logged(kind)]

    def run_url(self) -> str:
        """The run this launch started or resumed, as ftlaunch said on the console."""
        found = re.search(r"\[ftlaunch\] run (\S+): (?:new|resuming)", self.stderr)
        assert found, f"no run named on the console:\n{self.stderr}"
        return found.group(1)

    def run_state(self) -> RunState:
        return run_state(self.run_url())

    def survivors(self) -> List[psutil.Process]:
        return processes_with_marker(self.marker)

    def survivors_after(self, timeout: float = 10.0) -> List[psutil.Process]:
        """Survivors once the kernel has had up to ``timeout`` s to finish kills already on their way
        (after a kill -9 of the supervisor, the orphan guard and PDEATHSIG act asynchronously)."""
        return _wait_for_none(self.marker, timeout)

    def wait_for_event(
        self, kind: Type[E], match: Callable[[E], bool] = lambda _: True, timeout: float = 30.0
    ) -> E:
        """Bounded wait until this node's event log holds an event of ``kind`` that ``match``
        accepts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(kind) if match(e)]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(
            f"no matching {kind.__name__} in {self.log_dir / 'events.jsonl'} after {timeout}s"
        )


def read_logged(path: Path) -> List[Logged]:
    """The typed events of an events.jsonl; a line being written is not read half."""
    text = path.read_text() if path.exists() else ""
    complete = text[: text.rfind("\n") + 1]
    return [found for found in map(parse_logged, map(json.loads, complete.splitlines())) if found is not None]


# The options that choose how a launch starts its workers.
_SPAWNER_OPTIONS = {"--fork-server", "--no-fork-server", "--preload", "--warm-spare"}
# Worker scripts that import nothing but the standard library (the actor, only where its behaviour
# needs it): for them, the fork server's torch is 4-5 s of CPU a launch that saves nothing.
_NO_TORCH = {str(SCRIPTS / name) for name in ("actor.py", "waiter.py", "own_checkpoints.py")}


class Launcher:
    """Starts ``python -m launcher ...`` in its own session and cleans up after the test."""

    def __init__(self, tmp_path: Path, spawner: Sequence[str] = ()) -> None:
        """``spawner``: options put before the launch's own where its script imports no torch and it
        names no way to start the workers itself (``--no-fork-server`` in modules whose subject is
        not how workers start)."""
        self.tmp_path = tmp_path
        self.spawner = tuple(spawner)
        self.launches: List[Launch] = []

    def start(
        self,
        *args: str,
        env: Optional[dict] = None,
        log_dir: Union[Path, bool, None] = None,
        up_file: Optional[Path] = None,
        ignore_sighup: bool = False,
        prelude: str = "",
        wrap: Sequence[str] = (),
    ) -> Launch:
        """``up_file``: created once the interpreter has started (``site`` imported) and is about to
        run ftlaunch's entry point, for tests that time a signal from there. ``prelude``: Python run
        in the supervisor before its entry point (a test that plants a defect of ftlaunch's own).
        ``log_dir=False``: ftlaunch's own default. ``wrap``: a command that runs ftlaunch's
        (``unshare --pid --fork``); ``proc`` is then the wrapper."""
        marker = uuid.uuid4().hex
        if log_dir is None:
            log_dir = self.tmp_path / f"logs_{len(self.launches)}"
        full_env = {**os.environ, MARKER: marker, **(env or {})}
        argv = [sys.executable, "-m", "launcher"] + (["--log-dir", str(log_dir)] if log_dir else [])
        if up_file is not None or prelude:
            lines = [prelude]
            if up_file is not None:
                # Ctrl+C as in a terminal: a harness started in the background (`cmd &` in a script)
                # hands its children SIGINT ignored, and one sent before ftlaunch's inbox is open
                # would be lost to that, not to ftlaunch. The file is made once the entry module
                # is found and loaded: while CPython's import machinery looks for it (as while it
                # imports site), no code of ftlaunch's runs that could answer a signal.
                lines += [
                    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)",
                    "from launcher.__main__ import entry",
                    f"open({str(up_file)!r}, 'w').close()",
                ]
            argv[1:3] = ["-c", "\n".join([*lines, "from launcher.__main__ import entry; entry()"])]
        if "--run-dir" not in args:  # runs live in the test's own directory, never the repo's
            argv += ["--run-dir", str(self.tmp_path / "runs")]
        if _NO_TORCH.intersection(args) and not _SPAWNER_OPTIONS.intersection(args):
            argv += self.spawner
        argv = [*wrap, *argv, *args]
        proc = subprocess.Popen(
            argv,
            env=full_env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # SIGHUP as a terminal's shell leaves it (default), or as nohup does (ignored): never as
            # the test run happened to inherit it (a CI started under nohup ignores it).
            preexec_fn=lambda: signal.signal(
                signal.SIGHUP, signal.SIG_IGN if ignore_sighup else signal.SIG_DFL
            ),
        )
        launch = Launch(proc, log_dir, marker)
        self.launches.append(launch)
        return launch

    def run(self, *args: str, timeout: float = 90, **kwargs) -> Launch:
        launch = self.start(*args, **kwargs)
        launch.wait(timeout)
        return launch

    def cleanup(self) -> List[str]:
        """Stop anything left, by PID, and report what had survived: processes, and the memory
        tier's folder in /dev/shm (its supervisor, or its orphan guard after a kill -9, removes
        it; whatever the run's end, nothing may stay)."""
        leaked = []
        for launch in self.launches:
            if launch.proc.poll() is None:
                launch.proc.kill()
                launch.proc.wait()
                leaked.append(f"supervisor {launch.proc.pid}")
            for proc in _wait_for_none(launch.marker, timeout=2.0):
                leaked.append(f"{proc.pid} {' '.join(proc.cmdline())}")
                proc.kill()
            for folder in _memory_left(launch.proc.pid, timeout=10.0):
                leaked.append(f"memory tier {folder}")
                shutil.rmtree(folder, ignore_errors=True)
        return leaked


def memory_folders(pid: int) -> List[Path]:
    """The memory-tier folders in /dev/shm of the supervisor with ``pid``."""
    return list(Path("/dev/shm").glob(f"ftlaunch-memory-owned-{pid}-*"))


def _memory_left(pid: int, timeout: float) -> List[Path]:
    """A dead supervisor's memory-tier folders once its orphan guard has had up to ``timeout`` s
    to remove them; bounded."""
    return _until_none(lambda: memory_folders(pid), timeout)


def _wait_for_none(marker: str, timeout: float) -> List[psutil.Process]:
    """Give the kernel a moment to finish SIGKILLs already sent; bounded."""
    return _until_none(lambda: processes_with_marker(marker), timeout)


def until(predicate: Callable[[], object], timeout: float = 10.0, look: float = 0.01) -> object:
    """``predicate()``'s first true value within ``timeout`` s (evidence, never a fixed sleep);
    an AssertionError past it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:g} s"
        time.sleep(look)


def _until_none(look: Callable[[], list], timeout: float) -> list:
    """``look()`` until it finds nothing or ``timeout`` s pass; what it found last."""
    deadline = time.monotonic() + timeout
    while True:
        left = look()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def wait_for_files(folder: Path, pattern: str, count: int, timeout: float = 30) -> List[Path]:
    """Bounded wait until ``count`` files match (workers announce they are up this way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern)) if folder.exists() else []
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"only {len(found)} of {count} {pattern} in {folder} after {timeout}s")


def run_state(where: Union[Path, str]) -> RunState:
    """A run's run.json, read as ftlaunch reads it (``where``: the run's folder, or its URL)."""
    state = RunDir(str(where)).read_state()
    assert state is not None, f"no run.json in {where}"
    return state


def dead_pid() -> int:
    """A pid no process has now (the highest free one), found without starting a process."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid")


def frozen_at(launch: "Launch", point: str, timeout: float = 90.0) -> None:
    """Wait until a supervisor run with ``FTLAUNCH_FAILPOINT`` says it reached ``point``, then
    until the kernel shows it stopped there (launcher/core/failpoints.py)."""
    launch.read_console_until(lambda line: f"ftlaunch failpoint {point}" in line, timeout, stream="stderr")
    proc, deadline = psutil.Process(launch.proc.pid), time.monotonic() + 10
    while proc.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, proc.status()
        time.sleep(0.02)


@contextlib.contextmanager
def tiny_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` ("256k") at ``mount``: a /dev/shm that fills up (mounting needs root,
    as CI and the dev machines run)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI and dev machines run as root)")
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
