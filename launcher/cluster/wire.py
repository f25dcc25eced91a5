"""What the nodes of one attempt tell each other, as keys in that attempt's store (fresh per
attempt, under the rendezvous round's prefix), and the records behind them:

    node/<n>      who node n is (host, pid, nproc, command); claim/<n>: one node per rank
    plan          node 0: the attempt, its nodes, world size and workers' store (or why refused)
    alive/<n>     a counter a thread bumps; silent for --node-timeout: lost
    interrupt     the first node to see a failure, hang, lost node or signal (first wins; watched)
    stop/<n>      where node n's ranks are once asked to stop; every node computes one stop step
    progress/<n>  node n's ranks' steps every 5 s, for node 0's progress.json
    report/<n>    how the attempt ended on node n
    verdict       node 0: restart, or end the job with an exit code

The lists nodes, planned, reported, acked ("n," appended) tell node 0 who did what in one call.
"""

import dataclasses
import enum
import json
import os
import socket
import time
from typing import Dict, List, Optional, Sequence, Tuple

from launcher.core.failures import Failure, failure_from_json, failure_to_json
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.stopping import StopReading

__all__ = [
    "RoundPlan",
    "Interrupt",
    "InterruptKind",
    "JobVerdict",
    "NodeInfo",
    "copy_servers",
    "NodeReport",
    "plan_problem",
    "reading_from_json",
    "reading_to_json",
]


class InterruptKind(str, enum.Enum):
    FAILURE = "failure"  # a rank crashed or hung on that node
    STOP = "stop"  # a signal (preemption, Ctrl+C) reached that node
    LOST = "lost"  # a node's supervisor went silent
    RESIZE = "resize"  # node 0: a node waits to join an elastic job; every rank stops at one step
    REFUSED = "refused"  # a node refused node 0's plan (plan_problem): the job cannot run as planned

    @property
    def asks_to_stop(self) -> bool:
        """Every rank is asked to reach one step, save it and leave (not stopped at once)."""
        return self in (InterruptKind.STOP, InterruptKind.RESIZE)


@dataclasses.dataclass(frozen=True)
class Interrupt:
    node: int  # who raised it
    kind: InterruptKind
    detail: str  # one line
    signum: Optional[int] = None  # STOP: the signal

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "kind": self.kind.value})

    @classmethod
    def from_json(cls, text: str) -> "Interrupt":
        data = json.loads(text)
        return cls(**{**data, "kind": InterruptKind(data["kind"])})


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    node: int
    host: str
    pid: int
    nproc: int
    command: List[str]
    standby: int = 0  # its --standby-nodes: every node must agree on who may stand by
    copies: str = ""  # HOST:PORT of its copy server (--memory-peers); "": it takes no copies

    @classmethod
    def here(cls, node: int, nproc: int, command, standby: int = 0, copies: str = "") -> "NodeInfo":
        return cls(node, socket.gethostname(), os.getpid(), nproc, list(command), standby, copies)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """Node 0's plan of a rendezvous round, published to every node of it (each node turns it into
    its own ``roles.role.AttemptPlan``)."""

    attempt: int
    master_addr: str
    master_port: int
    nodes: List[int] = dataclasses.field(default_factory=list)  # the training nodes, in position order
    refused: str = ""  # node 0 refuses the round (nodes disagree): the reason, for every node
    world_size: int = 0  # every rank's WORLD_SIZE: each node checks it before it starts a rank
    round_failed: str = ""  # a node of the round never announced itself: why; every node meets again
    standby: List[int] = dataclasses.field(default_factory=list)  # the round's nodes that stand by
    copies: List[list] = dataclasses.field(default_factory=list)  # [node, host, its copy server]

    def copy_servers(self) -> Tuple[Tuple[int, str, str], ...]:
        """(node, host, HOST:PORT) of each node of the round that takes copies (--memory-peers)."""
        return tuple((int(node), str(host), str(at)) for node, host, at in self.copies)


def copy_servers(infos: Dict[int, NodeInfo]) -> List[list]:
    """``RoundPlan.copies`` from the nodes' announcements."""
    return [[node, info.host, info.copies] for node, info in sorted(infos.items()) if info.copies]


def plan_problem(plan: RoundPlan, node: int, nproc: int, fewest: int, nnodes: int, standby: int = 0) -> str:
    """Why ``node`` must not start a rank on (or stand by in) ``plan`` ('' when it may), checked by
    every node before any worker starts: a job never trains at a size it was not asked for."""
    nodes, spare = list(plan.nodes), list(plan.standby)
    asked = f"--nnodes {fewest}:{nnodes}" if fewest < nnodes else f"--nnodes {nnodes}"
    if standby:
        asked += f" --standby-nodes {standby}"
    if node not in nodes + spare:
        return f"node 0's plan for attempt {plan.attempt} leaves out node {node}: nodes {nodes}"
    every = nodes + spare
    if len(set(every)) != len(every) or not all(0 <= n < nnodes + standby for n in every):
        return f"node 0's plan for attempt {plan.attempt} names impossible nodes {every} ({asked})"
    if (spare and not standby) or (standby and nodes[:1] != [0]):  # node 0 leads: position 0
        return f"node 0's plan for attempt {plan.attempt} names impossible nodes {every} ({asked})"
    if len(nodes) > nnodes or (spare and len(nodes) < nnodes):  # a standby idles while a place is free
        return f"node 0 planned attempt {plan.attempt} on nodes {nodes}, standing by {spare}: {asked}"
    if len(nodes) < fewest:
        return f"node 0 planned attempt {plan.attempt} on {len(nodes)} node(s) {nodes}: {asked} asks for more"
    if plan.world_size != len(nodes) * nproc:
        return (
            f"node 0 planned attempt {plan.attempt} at WORLD_SIZE {plan.world_size}, but "
            f"{len(nodes)} node(s) x --nproc {nproc} make {len(nodes) * nproc}"
        )
    return ""


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """How one attempt ended on one node (failures with their log tails already attached)."""

    node: int
    outcome: str  # AttemptOutcome value
    failures: List[Failure]
    beat: bool
    furthest_step: Optional[int]
    signum: Optional[int] = None
    restored: str = ""  # --memory-peers: its ranks' snapshots came from another node's copy
    # rank (as text) → [the last collective it entered, its kind]: a hang's culprit, across nodes
    collectives: Dict[str, List] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return _dump_with_failures(self)

    @classmethod
    def from_json(cls, text: str) -> "NodeReport":
        return _load_with_failures(cls, text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobVerdict:
    """Node 0's decision after an attempt, for every node: built by ``restart`` or ``end``."""

    restarts: bool
    exit_code: int
    status: str  # RunStatus value (when the job ends)
    reason: str
    outcome: str  # the job's AttemptOutcome for this attempt
    failures: List[Failure]  # every node's
    same_round: bool = False  # restart: the same nodes hold the next attempt on this round
    cause: str = ""  # why the attempt ended, in the job's words (node 0's)
    excluded: List[int] = dataclasses.field(default_factory=list)  # restart: nodes that must leave (exit 8)
    excluded_why: str = ""

    @classmethod
    def restart(
        cls,
        outcome: AttemptOutcome,
        failures: List[Failure],
        *,
        same_round: bool,
        cause: str = "",
        excluded: Sequence[int] = (),
        excluded_why: str = "",
    ) -> "JobVerdict":
        """The job goes on: ``same_round``, on the same nodes at once, without a new round; the
        ``excluded`` nodes (--exclude-after) leave it, unhealthy."""
        status = RunStatus.RUNNING.value
        return cls(
            restarts=True, exit_code=0, status=status, reason="restart", outcome=outcome.value,
            failures=failures, same_round=same_round, cause=cause, excluded=list(excluded),
            excluded_why=excluded_why,
        )  # fmt: skip

    @classmethod
    def end(
        cls,
        exit_code: int,
        status: RunStatus,
        reason: str,
        outcome: AttemptOutcome,
        failures: List[Failure],
        *,
        cause: str = "",
    ) -> "JobVerdict":
        """The job is over, every node exits with ``exit_code``."""
        return cls(
            restarts=False, exit_code=int(exit_code), status=status.value, reason=reason,
            outcome=outcome.value, failures=failures, cause=cause,
        )  # fmt: skip

    def to_json(self) -> str:
        return _dump_with_failures(self)

    @classmethod
    def from_json(cls, text: str) -> "JobVerdict":
        return _load_with_failures(cls, text)


def reading_to_json(reading: StopReading) -> str:
    return json.dumps(dataclasses.asdict(reading))


def reading_from_json(text: str) -> StopReading:
    data = json.loads(text)
    return StopReading(bool(data["aware"]), int(data["furthest"]), float(data["rate"]))


def _clock_offset() -> float:
    return time.time() - time.monotonic()


def _dump_with_failures(record) -> str:
    """A record whose ``failures`` cross machines (their times as wall-clock time)."""
    offset = _clock_offset()
    data = dataclasses.asdict(record)
    data["failures"] = [failure_to_json(f, offset) for f in record.failures]
    return json.dumps(data)


def _load_with_failures(cls, text: str):
    data = json.loads(text)
    offset = _clock_offset()
    return cls(**{**data, "failures": [failure_from_json(f, offset) for f in data["failures"]]})
