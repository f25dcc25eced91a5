"""The --chaos SPEC grammar, parsed into a frozen plan (no clock, no processes here).

    SPEC   = CLAUSE { ";" CLAUSE }
    CLAUSE = "seed=" INT  |  FAULT [ ":" PARAM { "," PARAM } ]
    FAULT  = "kill" (SIGKILL) | "segv" (SIGSEGV) | "hang" (SIGSTOP: the rank stops, a hang)
           | "raise" (an exception in the training thread, at its next heartbeat)
           | "sleep" (the training thread sleeps for good, at its next heartbeat: a live hang)
           | "slow" (from its next heartbeat, each of the rank's steps takes factor= times as
                     long: a straggler, for the rehearsal of the slow-rank report)
           | "kill-node" (node=: its whole process tree SIGKILLed, once, for good: a machine lost)
           | "bad-node" (node=: its ranks SIGKILLed in every attempt, at= after the attempt's
                         start or at its step: a bad GPU)
    PARAM  = "rank=" (INT | "random")          which rank (default: random)
           | "node=" INT                       kill-node and bad-node: which node (a node rank,
                                               not 0: node 0 cannot be replaced)
           | "at=" DURATION                    once, this long after ftlaunch started
           | "at=step:" INT                    once, when a rank's heartbeat reaches the step
           | "at=save"                         once, half-way through writing the rank's next
                                               checkpoint part (kill, segv, hang)
           | "at=commit"                       once, after the rank's next part is written and
                                               before the step is committed (kill, segv, hang)
           | "every=" DURATION                 again and again, counted while workers run
           | "jitter=" DURATION                with every=: each wait is every ± up to this
           | "times=" INT                      at most this many (default: 1 for at=, no limit for every=)
           | "factor=" NUMBER                  slow: how many times as long (more than 1, at most
                                               100; default 2)

kill, segv and hang at a time or a step are the supervisor's signals (any script); the others
are worker_lib's, asked through the heartbeat slot. kill-node and bad-node take node= and at=
(DURATION or step:N) only, bad-node also times= (at most that many attempts; default: every one).

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
    SLOW = "slow"  # each of the rank's steps takes factor times as long
    KILL_NODE = "kill-node"  # a node's whole tree, once and for good
    BAD_NODE = "bad-node"  # a node's ranks, in every attempt

    @property
    def signum(self) -> int:
        """The signal the rank dies or stops of; 0: it does not (an exception, a sleep)."""
        return _SIGNALS.get(self.value, 0)

    @property
    def of_a_node(self) -> bool:
        """It names a node (node=), not a rank."""
        return self in (FaultKind.KILL_NODE, FaultKind.BAD_NODE)


_SIGNALS = {
    "kill": signal.SIGKILL,
    "segv": signal.SIGSEGV,
    "hang": signal.SIGSTOP,
    "kill-node": signal.SIGKILL,
    "bad-node": signal.SIGKILL,
}


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
    node: Optional[int] = None  # kill-node, bad-node: the node rank they act on
    factor: float = 0.0  # slow: how many times as long each step takes; 0 for the others

    def __str__(self) -> str:
        who = f"node={self.node}" if self.kind.of_a_node else f"rank={_rank_text(self.rank)}"
        times = "" if self.times == _default_times(self.kind, self.trigger) else f",times={self.times}"
        factor = f",factor={self.factor:g}" if self.kind is FaultKind.SLOW else ""
        return f"{self.kind.value}:{who},{self.trigger}{times}{factor}"


def _rank_text(rank: Optional[int]) -> str:
    return "random" if rank is None else str(rank)


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

    def check_nodes(self, members: int, given: str) -> None:
        """``members``: the job's node ranks (training and standby), as ``given`` on the command line."""
        for fault in self.faults:
            if fault.node is None:
                continue
            if members < 2:
                raise UsageError(
                    f"{_OPTION}: {fault.kind.value} needs a job of many nodes (--nnodes 2 or more)"
                )
            if fault.node >= members:
                raise UsageError(
                    f"{_OPTION}: {fault.kind.value} names node {fault.node}, "
                    f"outside 1..{members - 1} ({given})"
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
        if not sep or key not in ("rank", "node", "at", "every", "jitter", "times", "factor"):
            raise UsageError(
                f"{_OPTION}: {param!r} in {clause!r} is not rank=, node=, at=, every=, jitter=, times= "
                "or factor="
            )
        if key in values:
            raise UsageError(f"{_OPTION}: {key}= given twice in {clause!r}")
        values[key] = value.strip()
    if "factor" in values and kind is not FaultKind.SLOW:
        raise UsageError(f"{_OPTION}: factor= goes with slow, in {clause!r}")
    if kind.of_a_node:
        return _node_fault(kind, values, clause)
    if "node" in values:
        raise UsageError(
            f"{_OPTION}: node= goes with kill-node and bad-node (a rank fault takes rank=), in {clause!r}"
        )
    trigger = _trigger(values, clause)
    if trigger.kind in (TriggerKind.SAVE, TriggerKind.COMMIT) and not kind.signum:
        raise UsageError(
            f"{_OPTION}: {kind.value} cannot be at={trigger.kind.value} (kill, segv or hang can), "
            f"in {clause!r}"
        )
    rank_text = values.get("rank", "random")
    rank = None if rank_text.lower() == "random" else _integer(rank_text, "rank", minimum=0)
    times = _default_times(kind, trigger)
    if "times" in values:
        times = _integer(values["times"], "times", minimum=1)
    factor = _factor(values.get("factor", "2"), clause) if kind is FaultKind.SLOW else 0.0
    return Fault(kind, trigger, rank, times, factor=factor)


def _factor(text: str, clause: str) -> float:
    """slow's factor=: more than 1 and at most 100, in hundredths (as the slot word carries it)."""
    try:
        factor = round(float(text), 2)
    except ValueError:
        factor = float("nan")
    if not 1 < factor <= 100:  # NaN fails it too
        raise UsageError(
            f"{_OPTION}: factor= must be a number more than 1 and at most 100, got {text!r} in {clause!r}"
        )
    return factor


# What a node fault refuses, and why (a node is lost once; each attempt starts the clock anew).
_NOT_FOR_NODES = {
    "rank": "names a node (node=), not a rank",
    "every": "takes at= (kill-node: once; bad-node: in every attempt)",
    "jitter": "takes at= (kill-node: once; bad-node: in every attempt)",
}


def _node_fault(kind: FaultKind, values: dict, clause: str) -> Fault:
    for key, why in _NOT_FOR_NODES.items():
        if key in values:
            raise UsageError(f"{_OPTION}: {kind.value} {why}, not {key}=, in {clause!r}")
    if "node" not in values:
        raise UsageError(f"{_OPTION}: {kind.value} needs node=N (a node rank of 1 or more), in {clause!r}")
    node = _integer(values["node"], "node", minimum=0)
    if node == 0:
        raise UsageError(
            f"{_OPTION}: {kind.value} cannot name node 0: it leads (it hosts the stores and holds the run) "
            f"and cannot be replaced; name a node rank of 1 or more, in {clause!r}"
        )
    if kind is FaultKind.KILL_NODE and "times" in values:
        raise UsageError(f"{_OPTION}: kill-node loses its node once and for good: no times=, in {clause!r}")
    if "at" not in values:
        raise UsageError(f"{_OPTION}: {kind.value} needs at=DURATION or at=step:N, in {clause!r}")
    trigger = _trigger(values, clause)
    if trigger.kind in (TriggerKind.SAVE, TriggerKind.COMMIT):
        raise UsageError(
            f"{_OPTION}: {kind.value} takes at=DURATION or at=step:N, not at={trigger.kind.value}, "
            f"in {clause!r}"
        )
    times = (
        _integer(values["times"], "times", minimum=1) if "times" in values else _default_times(kind, trigger)
    )
    return Fault(kind, trigger, None, times, node)


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


def _default_times(kind: FaultKind, trigger: Trigger) -> Optional[int]:
    """at= fires once; every= and bad-node (each attempt) have no limit."""
    return None if trigger.kind is TriggerKind.EVERY or kind is FaultKind.BAD_NODE else 1


def _integer(text: str, what: str, minimum: int) -> int:
    try:
        value = whole_number(text)
    except ValueError:
        raise UsageError(f"{_OPTION}: {what} takes a whole number, got {text.strip()!r}") from None
    if value < minimum:
        raise UsageError(f"{_OPTION}: {what} must be {minimum} or more, got {value}")
    return value
