"""Typed failure records: what a worker's death tells us, in words a person can act on."""

import dataclasses
import json
import signal
from pathlib import Path
from typing import Optional, Sequence, Tuple

__all__ = ["ErrorRecord", "ProcessFailure", "describe_exit", "read_error_file", "root_cause"]


@dataclasses.dataclass(frozen=True)
class ErrorRecord:
    """An uncaught exception as torch.distributed.elastic's ``@record`` wrote it."""

    message: str  # e.g. "ValueError: boom"
    traceback: str = ""
    timestamp: int = 0  # wall-clock seconds, as @record writes it


@dataclasses.dataclass(frozen=True)
class ProcessFailure:
    """One worker that ended with a non-zero status."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int  # as Popen reports it: negative for "killed by signal -N"
    observed_at: float  # time.monotonic() when the supervisor saw the exit
    error: Optional[ErrorRecord] = None
    log_file: Optional[Path] = None
    log_tail: Tuple[str, ...] = ()  # filled in once the log pump has drained the rank's pipes

    def describe(self) -> str:
        """One line: "rank 1 (pid 42): Signal 11 (SIGSEGV)" or "...: ValueError: boom (exit code 1)"."""
        how = describe_exit(self.exitcode)
        what = f"{self.error.message} ({how})" if self.error else how
        return f"rank {self.rank} (pid {self.pid}): {what}"


def describe_exit(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    return f"Signal {-exitcode} ({name})"


def root_cause(failures: Sequence[ProcessFailure]) -> ProcessFailure:
    """The earliest failure: later ones are usually peers dying of the first (a broken collective).

    Exits seen in the same poll are ordered by the time their exception was recorded, where known.
    """
    return min(failures, key=lambda f: (f.observed_at, f.error.timestamp if f.error else 0, f.rank))


def read_error_file(path: Path) -> Optional[ErrorRecord]:
    """Parse @record's JSON; None when the worker wrote none (or something unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return ErrorRecord(message=message, timestamp=int(data.get("timestamp", 0) or 0))
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        return ErrorRecord(
            message=str(message.get("message", "")),
            traceback=str(extra.get("py_callstack", "")),
            timestamp=int(extra.get("timestamp", 0) or 0),
        )
    return None
