"""The --chaos SPEC grammar, parsed into a frozen plan (no clock, no processes here).

    SPEC   = CLAUSE { ";" CLAUSE }
    CLAUSE = "seed=" INT  |  FAULT [ ":" PARAM { "," PARAM } ]
    FAULT  = "kill" (SIGKILL) | "segv" (SIGSEGV) | "hang" (SIGSTOP: the rank stops, a hang)
           | "raise" (an exception in the training thread, at its next heartbeat)
           | "sleep" (the training thread sleeps for good, at its next heartbeat: a live hang)
    PARAM  = "rank=" (INT | "random")          which rank (default: random)
           | "at=" DURATION                    once, this long after ftlaunch started
           | "at=step:" INT                    once, when a rank's heartbeat reaches the step
           | "at=save"                         once, half-way through writing the rank's next
                                               checkpoint part (kill, segv, hang)
           | "at=commit"                       once, after the rank's next part is written and
                                               before the step is committed (kill, segv, hang)
           | "every=" DURATION                 again and again, counted while workers run
           | "jitter=" DURATION                with every=: each wait is every ± up to this
           | "times=" INT                      at most this many (default: 1 for at=, no limit for every=)

kill, segv and hang at a time or a step are the supervisor's signals (any script); the others
are worker_lib's, asked through the heartbeat slot.

Example: ``kill:rank=random,every=30s,jitter=10s;hang:at=step:500;seed=7``.
"""

import dataclasses
import enum
import signal
from typing import Optional, Tuple

from launcher.grammar.durations import parse_duration
from launcher.grammar.errors import UsageError
from launcher.grammar.numbers import whole_number

__all__ = ["ChaosPlan", "Fault", "FaultKind", "Trigger", "TriggerKind", "parse_chaos"]

_OPTION = "--chaos"


class FaultKind(str, enum.Enum):
    KILL = "kill"
    SEGV = "segv"
    HANG = "hang"
    RAISE = "raise"
    SLEEP = "sleep"

    @property
    def signum(self) -> int:
        """The signal the rank dies or stops of; 0: it does not (an exception, a sleep)."""
        return {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "hang": signal.SIGSTOP}.get(self.value, 0)


class TriggerKind(str, enum.Enum):
    TIME = "time"  # ``at`` seconds after the supervisor started
    STEP = "step"  # a rank's heartbeat step reached ``at``
    SAVE = "save"  # half-way through writing the rank's next checkpoint part
    COMMIT = "commit"  # the rank's next part written, the step not yet committed
    EVERY = "every"  # every ``at`` seconds of running workers, ± ``jitter``


@dataclasses.dataclass(frozen=True)
class Trigger:
    kind: TriggerKind
    at: float = 0.0  # seconds (TIME, EVERY) or a step (STEP)
    jitter: float = 0.0

    def __str__(self) -> str:
        if self.kind is TriggerKind.TIME:
            return f"at={self.at:g}s"
        if self.kind is TriggerKind.STEP:
            return f"at=step:{int(self.at)}"
        if self.kind in (TriggerKind.SAVE, TriggerKind.COMMIT):
            return f"at={self.kind.value}"
        return f"every={self.at:g}s" + (f",jitter={self.jitter:g}s" if self.jitter else "")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: FaultKind
    trigger: Trigger
    rank: Optional[int] = None  # None: a random rank each time
    times: Optional[int] = 1  # None: no limit

    def __str__(self) -> str:
        rank = "random" if self.rank is None else str(self.rank)
        times = "" if self.times == _default_times(self.trigger) else f",times={self.times}"
        return f"{self.kind.value}:rank={rank},{self.trigger}{times}"


@dataclasses.dataclass(frozen=True)
class ChaosPlan:
    faults: Tuple[Fault, ...]
    seed: int

    def __str__(self) -> str:
        return ";".join([*map(str, self.faults), f"seed={self.seed}"])

    def check_ranks(self, world_size: int) -> None:
        for fault in self.faults:
            if fault.rank is not None and not 0 <= fault.rank < world_size:
                raise UsageError(
                    f"{_OPTION}: {fault.kind.value} names rank {fault.rank}, outside 0..{world_size - 1}"
                )


def parse_chaos(spec: str, default_seed: int) -> ChaosPlan:
    """``spec`` as the user wrote it; ``default_seed`` when it names none (printed, to replay)."""
    faults, seed = [], None
    clauses = [c.strip() for c in spec.split(";") if c.strip()]
    if not clauses:
        raise UsageError(f"{_OPTION} needs at least one fault, e.g. kill:every=30s (got {spec!r})")
    for clause in clauses:
        if clause.startswith("seed="):
            seed = _integer(clause[len("seed=") :], "seed", minimum=0)
        else:
            faults.append(_fault(clause))
    if not faults:
        raise UsageError(f"{_OPTION} names a seed but no fault, e.g. kill:every=30s (got {spec!r})")
    return ChaosPlan(tuple(faults), default_seed if seed is None else seed)


def _fault(clause: str) -> Fault:
    name, _, params = clause.partition(":")
    try:
        kind = FaultKind(name.strip().lower())
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise UsageError(
            f"{_OPTION}: unknown fault {name.strip()!r} in {clause!r} (known: {known})"
        ) from None
    values = {}
    for param in filter(None, (p.strip() for p in params.split(","))):
        key, sep, value = param.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("rank", "at", "every", "jitter", "times"):
            raise UsageError(
                f"{_OPTION}: {param!r} in {clause!r} is not rank=, at=, every=, jitter= or times="
            )
        if key in values:
            raise UsageError(f"{_OPTION}: {key}= given twice in {clause!r}")
        values[key] = value.strip()
    trigger = _trigger(values, clause)
    if trigger.kind in (TriggerKind.SAVE, TriggerKind.COMMIT) and not kind.signum:
        raise UsageError(
            f"{_OPTION}: {kind.value} cannot be at={trigger.kind.value} (kill, segv or hang can), "
            f"in {clause!r}"
        )
    rank_text = values.get("rank", "random")
    rank = None if rank_text.lower() == "random" else _integer(rank_text, "rank", minimum=0)
    times = _default_times(trigger)
    if "times" in values:
        times = _integer(values["times"], "times", minimum=1)
    return Fault(kind, trigger, rank, times)


def _trigger(values: dict, clause: str) -> Trigger:
    if ("at" in values) == ("every" in values):
        raise UsageError(f"{_OPTION}: {clause!r} needs exactly one of at= and every=")
    if "jitter" in values and "every" not in values:
        raise UsageError(f"{_OPTION}: jitter= goes with every=, in {clause!r}")
    if "every" in values:
        every = parse_duration(values["every"], f"{_OPTION} every=")
        jitter = parse_duration(values.get("jitter", "0"), f"{_OPTION} jitter=")
        if every <= 0 or jitter >= every:
            raise UsageError(f"{_OPTION}: every= must be more than 0 and more than jitter=, in {clause!r}")
        return Trigger(TriggerKind.EVERY, every, jitter)
    at = values["at"]
    if at.lower() in ("save", "commit"):
        return Trigger(TriggerKind(at.lower()))
    if at.lower().startswith("step:"):
        return Trigger(TriggerKind.STEP, _integer(at[len("step:") :], "at=step:", minimum=0))
    return Trigger(TriggerKind.TIME, parse_duration(at, f"{_OPTION} at="))


def _default_times(trigger: Trigger) -> Optional[int]:
    """at= fires once; every= has no limit."""
    return None if trigger.kind is TriggerKind.EVERY else 1


def _integer(text: str, what: str, minimum: int) -> int:
    try:
        value = whole_number(text)
    except ValueError:
        raise UsageError(f"{_OPTION}: {what} takes a whole number, got {text.strip()!r}") from None
    if value < minimum:
        raise UsageError(f"{_OPTION}: {what} must be {minimum} or more, got {value}")
    return value
