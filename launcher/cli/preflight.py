"""Checks against the world that must pass before any worker starts: the entry point can run,
the node can hold the ranks, the store can listen, the storage can be written (within
``--storage-timeout``) and the log folder too. Each failure is one line and exit 2."""

import os
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from launcher.core.config import EntryKind, LaunchConfig
from launcher.grammar.errors import UsageError
from launcher.runs.probe import probe_storage, protocol_of

__all__ = ["preflight"]


def preflight(config: LaunchConfig, interrupted: Callable[[], None] = lambda: None) -> None:
    """Checks against the world (files, directories) that must pass before any worker starts.
    ``interrupted()`` raises when a signal came meanwhile: a slow check does not delay a Ctrl+C."""
    _check_entrypoint(config)
    _check_node_can_hold(config.group.nproc)
    if config.cluster.many_nodes and config.cluster.node_rank == 0:
        _check_node_0_can_host(config.cluster.nnodes, config.group.nproc)
    _check_store_address(config.group.master_addr, config.group.master_port)
    run_dir, checkpoints = "run dir (--run-dir)", "checkpoint storage (--checkpoint-dir)"  # named options
    _check_outside_this_process(run_dir, config.run.url, "the run would end with ftlaunch")
    if config.group.checkpoint_url:
        _check_outside_this_process(
            checkpoints,
            config.group.checkpoint_url,
            "each rank would have its own: nothing saved is ever loaded",
        )
    probe_storage(run_dir, config.run.url, config.run.storage_timeout, interrupted)
    if config.group.checkpoint_url:
        probe_storage(checkpoints, config.group.checkpoint_url, config.run.storage_timeout, interrupted)
    _check_log_dir_writable(config.group.log_dir)  # last: it creates the folder, which a failure would leave


def _check_entrypoint(config: LaunchConfig) -> None:
    """What would fail in every rank of every attempt fails here, once, before any worker starts."""
    if config.entry.kind is EntryKind.SCRIPT:
        _check_script(Path(config.entry.entrypoint))
    elif config.entry.kind is EntryKind.MODULE:
        _check_module(config.entry.python, config.entry.entrypoint)
    elif shutil.which(config.entry.entrypoint) is None:
        raise UsageError(f"executable not found or not executable: {config.entry.entrypoint}")


def _check_script(path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"{path} is a directory, not a Python script (name the file to run)")
    if not path.is_file():
        raise UsageError(f"script not found: {path}" if not path.exists() else f"{path} is not a file")
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


# Node 0 hosts the job's store: each other node keeps a connection or two to it open.
_CONNECTIONS_PER_NODE = 2


def _check_node_0_can_host(nnodes: int, nproc: int) -> None:
    """Node 0 can hold a connection from every node (--nnodes MAX of them) beside its own ranks'
    pipes and log files, within its open-file limit."""
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 64 + 3 * nproc + _CONNECTIONS_PER_NODE * nnodes
    if files != resource.RLIM_INFINITY and need > files:
        raise UsageError(
            f"--nnodes {nnodes}: node 0 hosts the job's store and needs about {need} open files (a "
            f"connection or two per node), more than its limit (ulimit -n {files}): raise it, or "
            "run fewer nodes"
        )


def _check_store_address(addr: str, port: int) -> None:
    """The workers' store can listen there: an address of this machine, a port that is free."""
    from launcher.process.attempt_store import listen

    try:
        listen(addr, port).close()
    except OSError as err:
        where = f"{addr}:{port}"
        raise UsageError(
            f"cannot listen on {where} for the workers' store (--master-addr, --master-port): "
            f"{err.strerror or err}"
        ) from None


def _check_log_dir_writable(log_dir: Path) -> None:
    probe = log_dir / f".ftlaunch-write-test-{os.getpid()}"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"log dir {log_dir} is not writable: {err.strerror or err}") from None


def _check_outside_this_process(what: str, url: str, why: str) -> None:
    """Storage that lives inside the process that opens it (fsspec's memory filesystem, alone or
    in a chain) passed the probe, but every worker opens its own: nothing saved was ever loaded,
    a crash loop. Asked before anything is written, and before any storage library is imported
    (that is the probe's, bounded and interruptible)."""
    if any(_memory_class(protocol_of(part)) for part in url.split("::")):
        raise UsageError(
            f"{what} {url}: fsspec keeps it inside the process that opens it ({why}); "
            "give a path or a store that every process reaches"
        )


def _memory_class(protocol: str) -> bool:
    """fsspec's class for ``protocol`` is its memory filesystem: a registered class asked itself,
    one not yet imported by the path fsspec's registry knows it by."""
    from fsspec.implementations.memory import MemoryFileSystem
    from fsspec.registry import known_implementations, registry

    if protocol in registry:
        return issubclass(registry[protocol], MemoryFileSystem)
    known: object = known_implementations.get(protocol, {}).get("class")
    return known == f"{MemoryFileSystem.__module__}.{MemoryFileSystem.__name__}"
