"""LaunchConfig: built once by the CLI, validated, frozen, passed down."""

import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, FrozenSet, List, Optional, Sequence, Tuple

from launcher.errors import UsageError
from worker_lib.backend import choose_backend

__all__ = ["EntryKind", "LaunchConfig", "default_run_name", "preflight", "visible_gpu_count"]


class EntryKind(str, enum.Enum):
    """How the entry point is run: ``python SCRIPT``, ``python -m MODULE`` or ``SCRIPT`` itself."""

    SCRIPT = "script"
    MODULE = "module"
    EXECUTABLE = "executable"  # --no-python


# Every duration field and the option that sets it.
_DURATION_OPTIONS = {
    "grace_period": "--grace-period",
    "init_timeout": "--init-timeout",
    "heartbeat_timeout": "--heartbeat-timeout",
    "heartbeat_floor": "--heartbeat-floor",
    "failure_window": "--failure-window",
    "backoff": "--backoff",
    "backoff_cap": "--max-backoff",
    "storage_timeout": "--storage-timeout",
    "lease": "--lease",
}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything one ftlaunch run needs; invariants are checked in ``__post_init__``."""

    entrypoint: str
    script_args: Tuple[str, ...] = ()
    entry_kind: EntryKind = EntryKind.SCRIPT
    nproc: int = 1
    max_failures: int = 3  # failed groups tolerated; -1: unlimited, 0: none
    backend: str = "gloo"  # resolved: "nccl" or "gloo", never "auto"
    log_dir: Path = Path("ftlaunch_logs")
    grace_period: float = 5.0  # seconds between SIGTERM and SIGKILL
    run_id: str = "ftlaunch"
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the OS picks a free port for each attempt's store
    console_ranks: Optional[FrozenSet[int]] = None  # None: every rank on the console
    checkpoint_url: Optional[str] = None  # fsspec URL handed to workers (worker_lib's storage root)
    init_timeout: float = 900.0  # seconds from start (or a pause) to a beat, once the script beats
    heartbeat_timeout: Optional[float] = None  # seconds between beats; None: auto; 0: off
    heartbeat_floor: float = 120.0  # the smallest deadline auto sets
    run_url: str = "ftlaunch_runs/run"  # fsspec URL of the run directory: <--run-dir>/<--run-name>
    run_name: str = "run"
    fresh: bool = False  # archive a finished run and start it again
    lease: float = 60.0  # seconds the run lock lasts without renewal
    failure_window: Optional[float] = None  # seconds; None: every failure counts
    crash_loop: int = 3  # failed attempts in a row known to have made no progress; 0: off
    max_preemptions: int = -1  # preempted attempts a run may resume from; -1: unlimited
    backoff: float = 1.0  # seconds before the second restart in a row; doubles after
    backoff_cap: float = 60.0
    storage_timeout: float = 20.0  # seconds the storage probes before start may take
    python: str = sys.executable

    def __post_init__(self) -> None:
        for name, option in _DURATION_OPTIONS.items():
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):  # nan compares false with everything
                raise UsageError(f"{option} must be a finite number of seconds, got {value}")
        if self.lease <= 0:
            raise UsageError(f"--lease must be more than 0 seconds, got {self.lease}")
        if self.storage_timeout <= 0:
            raise UsageError(f"--storage-timeout must be more than 0 seconds, got {self.storage_timeout}")
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        if self.max_failures < -1:
            raise UsageError(f"--max-failures must be -1 (unlimited) or more, got {self.max_failures}")
        if self.backend not in ("nccl", "gloo"):
            raise UsageError(f"backend must be resolved to nccl or gloo, got {self.backend!r}")
        if self.grace_period < 0:
            raise UsageError(f"--grace-period must be 0 or more seconds, got {self.grace_period}")
        if not 0 <= self.master_port < 65536:
            raise UsageError(f"--master-port must be in 0..65535, got {self.master_port}")
        if self.init_timeout <= 0 or self.heartbeat_floor <= 0:
            raise UsageError("--init-timeout and --heartbeat-floor must be more than 0 seconds")
        if self.heartbeat_timeout is not None and self.heartbeat_timeout < 0:
            raise UsageError(
                f"--heartbeat-timeout must be auto, off or seconds, got {self.heartbeat_timeout}"
            )
        if self.max_preemptions < -1:
            raise UsageError(f"--max-preemptions must be -1 (unlimited) or more, got {self.max_preemptions}")
        if self.crash_loop < 0:
            raise UsageError(f"--crash-loop must be 0 (off) or more, got {self.crash_loop}")
        if self.failure_window is not None and self.failure_window <= 0:
            raise UsageError("--failure-window must be more than 0 seconds")
        if self.console_ranks is not None:
            outside = sorted(r for r in self.console_ranks if not 0 <= r < self.nproc)
            if outside:
                raise UsageError(f"--console-ranks names ranks {outside} outside 0..{self.nproc - 1}")

    @property
    def world_size(self) -> int:
        return self.nproc

    @property
    def detects_hangs(self) -> bool:
        return self.heartbeat_timeout != 0

    @property
    def checkpoints_in_run_dir(self) -> bool:
        return self.checkpoint_url == f"{self.run_url}/checkpoints"

    def to_json(self) -> dict:
        """The configuration as run.json records it."""
        data = dataclasses.asdict(self)
        data["log_dir"] = str(self.log_dir)
        data["console_ranks"] = sorted(self.console_ranks) if self.console_ranks is not None else None
        return data

    @property
    def command(self) -> Tuple[str, ...]:
        """What makes a run this run: how and what it runs, with which arguments."""
        return (self.entry_kind.value, self.entrypoint, *self.script_args)

    @property
    def has_default_name(self) -> bool:
        return self.run_name == default_run_name(self.entry_kind, self.entrypoint, self.script_args)

    def shows_on_console(self, rank: int) -> bool:
        return self.console_ranks is None or rank in self.console_ranks

    def worker_argv(self) -> Tuple[str, ...]:
        """The command line every rank runs."""
        if self.entry_kind is EntryKind.MODULE:
            return (self.python, "-u", "-m", self.entrypoint, *self.script_args)
        if self.entry_kind is EntryKind.EXECUTABLE:
            return (self.entrypoint, *self.script_args)
        return (self.python, "-u", self.entrypoint, *self.script_args)


def default_run_name(kind: EntryKind, entrypoint: str, script_args: Sequence[str]) -> str:
    """The script's name and a hash of the command: the same command (run from the same place)
    finds the same run; other arguments (a sweep) make another run. Scripts are named by their
    absolute path, so a relative path names the same script only from the same directory."""
    if kind is EntryKind.MODULE:
        stem, target = entrypoint.rsplit(".", 1)[-1], entrypoint
    else:
        stem = Path(entrypoint).stem or "run"
        target = os.path.abspath(entrypoint) if kind is EntryKind.SCRIPT else entrypoint
    digest = hashlib.sha1(json.dumps([kind.value, target, *script_args]).encode()).hexdigest()
    return f"{stem}-{digest[:8]}"


def visible_gpu_count() -> int:
    """GPUs this node can use; asks NVML through torch, so no CUDA context is created."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a declared dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(requested: str, nproc: int, gpu_count: int) -> str:
    """Choose the backend and refuse nccl setups that cannot work, before anything starts."""
    try:
        backend = choose_backend(requested, gpu_count)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if backend == "nccl" and nproc > gpu_count:
        raise UsageError(f"--nproc {nproc} with nccl needs {nproc} GPUs, this node sees {gpu_count}")
    return backend


def preflight(config: LaunchConfig, interrupted: Callable[[], None] = lambda: None) -> None:
    """Checks against the world (files, directories) that must pass before any worker starts.
    ``interrupted()`` raises when a signal came meanwhile: a slow check does not delay a Ctrl+C."""
    _check_entrypoint(config)
    _check_node_can_hold(config.nproc)
    _check_store_address(config.master_addr, config.master_port)
    _probe_storage("run dir", config.run_url, config.storage_timeout, interrupted)
    if config.checkpoint_url:
        _probe_storage("checkpoint storage", config.checkpoint_url, config.storage_timeout, interrupted)
    _check_log_dir_writable(config.log_dir)  # last: it creates the folder, which a failure would leave


def _check_entrypoint(config: LaunchConfig) -> None:
    """What would fail in every rank of every attempt fails here, once, before any worker starts."""
    if config.entry_kind is EntryKind.SCRIPT:
        _check_script(Path(config.entrypoint))
    elif config.entry_kind is EntryKind.MODULE:
        _check_module(config.python, config.entrypoint)
    elif shutil.which(config.entrypoint) is None:
        raise UsageError(f"executable not found or not executable: {config.entrypoint}")


def _check_script(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"script not found: {path}")
    try:
        source = path.read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from None
    if b"\0" in source:  # Python source never holds a NUL byte; a program does
        raise UsageError(f"{path} is not a Python script (a program? --no-python runs it as an executable)")
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as err:  # decoding errors included
        where = f", line {err.lineno}" if err.lineno else ""
        raise UsageError(f"{path}{where}: {type(err).__name__}: {err.msg}") from None


def _check_module(python: str, name: str) -> None:
    """``python -m NAME`` would find it. Asked of the workers' interpreter in the workers' working
    directory, without importing NAME itself (only its parent packages, as ``-m`` does too)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
    try:
        found = subprocess.run(
            [python, "-c", probe, name], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UsageError(f"cannot check module {name}: {err}") from None
    if found.returncode == 3:
        raise UsageError(f"no module named {name!r} (python -m {name} would fail)")
    if found.returncode != 0:
        last = (found.stderr.strip().splitlines() or ["?"])[-1]
        raise UsageError(f"module {name}: {last}")


# Each worker is at least a Python interpreter: some tens of MB and a few threads, before any torch.
_WORKER_MEMORY = 16 * 2**20
_WORKER_THREADS = 4


def _check_node_can_hold(nproc: int) -> None:
    """A sane ceiling, from what this node has: its process limit, threads-max and memory."""
    import psutil

    ceilings = [(psutil.virtual_memory().available // _WORKER_MEMORY, "the memory available")]
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        ceilings.append((soft // _WORKER_THREADS, f"the process limit (ulimit -u {soft})"))
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files != resource.RLIM_INFINITY:  # the supervisor holds 3 per rank: two pipes and a log file
        ceilings.append(((files - 64) // 3, f"the open-file limit (ulimit -n {files})"))
    try:
        threads = int(Path("/proc/sys/kernel/threads-max").read_text())
        ceilings.append((threads // _WORKER_THREADS, f"kernel.threads-max {threads}"))
    except (OSError, ValueError):
        pass
    most, why = min(ceilings)
    if nproc > most:
        raise UsageError(
            f"--nproc {nproc} is more workers than this node can hold: at most about {most} ({why})"
        )


def _check_store_address(addr: str, port: int) -> None:
    """The workers' store can listen there: an address of this machine, a port that is free."""
    from launcher.process.store import listen

    try:
        listen(addr, port).close()
    except OSError as err:
        where = f"{addr}:{port}"
        raise UsageError(f"cannot listen on {where} for the workers' store: {err.strerror or err}") from None


def _check_log_dir_writable(log_dir: Path) -> None:
    probe = log_dir / f".ftlaunch-write-test-{os.getpid()}"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"log dir {log_dir} is not writable: {err.strerror or err}") from None


def _probe_storage(label: str, url: str, timeout: float, interrupted: Callable[[], None]) -> None:
    """Write and delete a probe object within ``timeout`` seconds: a malformed URL, a missing bucket,
    no permission or no answer at all is one line now, not a stack of retries once per restart.
    Storage libraries retry for a minute on their own; the probe runs in a daemon thread, and the
    last error they logged while it ran is the cause given when it does not finish."""
    from worker_lib.storage import Storage, StorageError

    failure: List[BaseException] = []

    def probe() -> None:
        try:
            Storage(url, label=label).check_writable("supervisor")
        except BaseException as err:  # reported by the caller's thread
            failure.append(err)

    deadline = time.monotonic() + timeout
    with _LastError() as last:
        thread = threading.Thread(target=probe, name="ftlaunch-storage-probe", daemon=True)
        thread.start()
        while thread.is_alive() and time.monotonic() < deadline:
            interrupted()
            thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
    if thread.is_alive():
        cause = f"; last error: {last.message}" if last.message else ""
        raise UsageError(f"{label} {url!r} did not answer within {timeout:g} s (--storage-timeout){cause}")
    if failure and isinstance(failure[0], StorageError):
        raise UsageError(str(failure[0])) from None
    if failure:
        raise failure[0]


class _LastError(logging.Handler):
    """Remembers the first line of the last error a library reported while installed: a warning,
    or a debug line about an exception (gcsfs says "retrying after exception: …" at debug level,
    so the root logger listens at debug meanwhile; the console's handler keeps its own level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.message = ""
        self._root_level = logging.WARNING

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip()
        about_an_error = any(word in text.lower() for word in ("exception", "error"))
        if text and (record.levelno >= logging.WARNING or about_an_error):
            self.message = text.splitlines()[0][:300]

    def __enter__(self) -> "_LastError":
        root = logging.getLogger()
        self._root_level = root.level
        root.setLevel(logging.DEBUG)
        root.addHandler(self)
        return self

    def __exit__(self, *_exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self._root_level)
