"""Typed failure records: what a worker's death tells us, in words a person can act on."""

import dataclasses
import json
import re
import signal
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple, Union

from launcher.core.beats import Phase

__all__ = [
    "ErrorRecord",
    "Failure",
    "HangFailure",
    "NodeLostFailure",
    "ProcessFailure",
    "describe_exit",
    "failure_from_json",
    "failure_to_json",
    "read_error_file",
    "root_cause",
    "sure_blame",
]


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
    node: Optional[int] = None  # the node rank in a job of many nodes
    injected: bool = False  # --chaos sent the signal it died of

    def describe(self) -> str:
        """One line: "rank 1 (pid 42): Signal 11 (SIGSEGV)" or "...: ValueError: boom (exit code 1)"."""
        how = describe_exit(self.exitcode)
        what = f"{self.error.message} ({how})" if self.error else how
        return f"rank {self.rank} ({_where(self.node, self.pid)}): {what}{_INJECTED if self.injected else ''}"

    @property
    def killed(self) -> bool:
        """Ended by a signal from outside or by its own fault (SIGKILL, SIGSEGV, ...): a peer whose
        collective broke raises instead (an exit code), or aborts (SIGABRT: NCCL's watchdog)."""
        return self.exitcode < 0 and -self.exitcode != signal.SIGABRT

    @property
    def blame_order(self) -> tuple:
        """A rank killed before one that exited: its peers' exits are the collective it broke, and
        which supervisor saw its death first is a race between nodes. Then the earliest seen, and
        exits seen in the same poll by the time their exception was recorded."""
        return (not self.killed, self.observed_at, self.error.timestamp if self.error else 0, self.rank)


@dataclasses.dataclass(frozen=True)
class HangFailure:
    """One worker that missed its heartbeat deadline (alive, but silent)."""

    rank: int
    local_rank: int
    pid: int
    phase: Phase
    silent_for: float  # seconds without a sign of life when the hang was declared
    deadline: float
    last_step: int  # -1: it never said
    observed_at: float  # time.monotonic() of its last sign of life
    log_file: Optional[Path] = None
    thread_id: int = 0  # its main thread, as the stack dump names it
    process_status: str = ""  # psutil's word when it was declared hung: "stopped", "disk-sleep", ...
    log_tail: Tuple[str, ...] = ()
    stack: Tuple[str, ...] = ()  # its main thread's frames, innermost first (from the stack dump)
    node: Optional[int] = None
    injected: bool = False  # --chaos stopped it (SIGSTOP)
    stalled: bool = False  # it beat, but at one step since ``observed_at``
    collective: int = -1  # the last collective it entered, settled (0: none; -1: not known)

    def describe(self) -> str:
        """One line: "rank 1 (pid 42): hung: no heartbeat for 5.1 s (deadline 5 s) after step 17, at ..."."""
        silence = {
            Phase.STARTING: "no first heartbeat",
            Phase.STEPPING: "beats without a new step" if self.stalled else "no heartbeat",
            Phase.PAUSED: "stuck in a save/load/pause",
        }[self.phase]
        step = f" {'at' if self.stalled else 'after'} step {self.last_step}" if self.last_step >= 0 else ""
        where = f", in {short_frame(self.stack[0])}" if self.stack else ""
        status = f", process {self.process_status}" if self.process_status in _NOTABLE_STATUS else ""
        return (
            f"rank {self.rank} ({_where(self.node, self.pid)}): hung: {silence} for {self.silent_for:.1f} s "
            f"(deadline {seconds(self.deadline)} s){step}{where}{status}{_INJECTED if self.injected else ''}"
        )

    @property
    def waits_on_peers(self) -> bool:
        """Stuck inside torch.distributed: most likely waiting for a rank that is hung itself."""
        return bool(self.stack) and "torch/distributed/" in self.stack[0]

    @property
    def blame_order(self) -> tuple:
        """A process frozen by the OS (stopped, traced, in uninterruptible I/O) explains its own
        silence; then the rank behind (lowest step) and not blocked in a collective; at one step,
        a rank that beats in place before the silent ones (they wait for it in a collective)."""
        frozen = self.process_status in _NOTABLE_STATUS
        return (
            not frozen,
            self.collective,  # behind the others' collective: they wait for it (root_cause)
            self.waits_on_peers,
            self.last_step,
            not self.stalled,
            self.observed_at,
            self.rank,
        )


@dataclasses.dataclass(frozen=True)
class NodeLostFailure:
    """A node whose supervisor stopped answering (killed, its machine rebooted or cut off)."""

    node: int
    host: str
    pid: int  # its supervisor
    silent_for: float
    observed_at: float  # time.monotonic() when it was declared lost
    rank: int = -1  # no one rank: every rank of that node is gone with it
    stalled: bool = False  # found by the node itself: its supervisor's process did not run
    unreported: float = 0.0  # it still beat, but sent no report within this many seconds
    closed: bool = False  # its supervisor's connection to node 0 closed: the process is gone

    def describe(self) -> str:
        if self.closed:
            return (
                f"node {self.node} ({self.host}, supervisor pid {self.pid}): lost: its supervisor is "
                f"gone (its connection to node 0 closed {self.silent_for:.1f} s after its last beat)"
            )
        if self.unreported:
            return (
                f"node {self.node} ({self.host}, supervisor pid {self.pid}): lost: no report within "
                f"{seconds(self.unreported)} s of the attempt's end, though its supervisor answered "
                f"{self.silent_for:.1f} s before (stuck starting or stopping its ranks?)"
            )
        if self.stalled:
            return (
                f"node {self.node} ({self.host}, supervisor pid {self.pid}): its supervisor did not run "
                f"for {self.silent_for:.1f} s (stopped or starved), so the other nodes lost it"
            )
        return (
            f"node {self.node} ({self.host}, supervisor pid {self.pid}): lost: no sign of life for "
            f"{self.silent_for:.1f} s"
        )

    @property
    def blame_order(self) -> tuple:
        return (self.observed_at, self.node)


Failure = Union[ProcessFailure, HangFailure, NodeLostFailure]

# Across kinds: a lost node explains every other failure of its attempt (its peers' collectives
# break); a crash explains hangs elsewhere (ranks waiting for the dead one).
_KIND_ORDER = {NodeLostFailure: 0, ProcessFailure: 1, HangFailure: 2}

_INJECTED = " [injected by --chaos]"

# Process states that explain a silence by themselves (SIGSTOP, a debugger, uninterruptible I/O).
_NOTABLE_STATUS = ("stopped", "tracing-stop", "disk-sleep")


def seconds(value: float) -> str:
    """2.0 → "2", 1.50216 → "1.5", 900.0 → "900": durations as people write them."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def describe_exit(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    return f"Signal {-exitcode} ({name})"


def _where(node: Optional[int], pid: int) -> str:
    return f"node {node}, pid {pid}" if node is not None else f"pid {pid}"


def root_cause(failures: Sequence[Failure]) -> Failure:
    """The failure that most likely caused the others: one --chaos injected (known, not
    guessed); for exits a rank killed by a signal, then the earliest (the others are usually peers
    dying of a broken collective); for hangs the rank that is behind."""
    # The hung ranks' last collectives are compared only when every one of them is known.
    compared = all(f.collective >= 0 for f in failures if isinstance(f, HangFailure))

    def order(f: Failure) -> tuple:
        blame = f.blame_order
        if isinstance(f, HangFailure) and not compared:
            blame = (blame[0], -1, *blame[2:])
        return (not getattr(f, "injected", False), _KIND_ORDER[type(f)], blame)

    return min(failures, key=order)


def sure_blame(failures: Sequence[Failure], first_to_tell: Optional[int]) -> Optional[int]:
    """The node of a failed attempt's root cause, where the evidence agrees: the root cause (by
    the nodes' wall clocks) and the first interrupt in node 0's store (raised by the first
    supervisor that saw a failure: an order without clocks) name the same node. None when they
    disagree (the clocks drifted further apart than the failure was ahead of the first one it
    caused elsewhere), when a node was lost, or when no node is named."""
    if not failures:
        return None
    cause = root_cause(failures)
    if isinstance(cause, NodeLostFailure) or cause.node is None or cause.node != first_to_tell:
        return None
    return cause.node


_KINDS = {cls.__name__: cls for cls in _KIND_ORDER}


def failure_to_json(failure: Failure, clock_offset: float) -> dict:
    """A failure as another node's supervisor receives it. ``observed_at`` travels as wall-clock
    time (``clock_offset`` = time.time() - time.monotonic() here): monotonic clocks are per machine."""
    data = json.loads(json.dumps(dataclasses.asdict(failure), default=str))
    data["observed_at"] = failure.observed_at + clock_offset
    return {"kind": type(failure).__name__, **data}


def failure_from_json(data: dict, clock_offset: float) -> Failure:
    """The inverse of ``failure_to_json`` on the receiving machine (its own ``clock_offset``)."""
    fields = dict(data)
    cls = _KINDS[fields.pop("kind")]
    fields["observed_at"] = float(fields["observed_at"]) - clock_offset
    if fields.get("log_file") is not None:
        fields["log_file"] = Path(fields["log_file"])
    for name in ("log_tail", "stack"):
        if name in fields:
            fields[name] = tuple(fields[name])
    if "phase" in fields:
        fields["phase"] = Phase(fields["phase"])
    if fields.get("error") is not None:
        fields["error"] = ErrorRecord(**fields["error"])
    failure: Failure = cls(**fields)
    return failure


def read_error_file(path: Path) -> Optional[ErrorRecord]:
    """Parse @record's JSON; None when the worker wrote none (or something unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return ErrorRecord(message=message, timestamp=_timestamp(data.get("timestamp")))
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        return ErrorRecord(
            message=str(message.get("message", "")),
            traceback=str(extra.get("py_callstack", "")),
            timestamp=_timestamp(extra.get("timestamp")),
        )
    return None


def _timestamp(value: Any) -> int:
    """@record's timestamp (an int, or its digits as a string); 0 (unknown) for anything else: the
    file is the worker's, written as it died, and its message is worth more than its time."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**40 else 0


_FRAME = re.compile(r'^File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>.*)$')


def short_frame(frame: str) -> str:
    """'File "/a/b/train.py", line 37 in step' → 'step (train.py:37)'."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    return f"{match['func']} ({Path(match['path']).name}:{match['line']})"
