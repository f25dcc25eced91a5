"""What the nodes of one attempt tell each other, as keys in that attempt's store (a prefix of
the rendezvous round's store, itself a prefix of node 0's store, fresh per attempt):

    node/<n>      each node: who it is (host, pid, nproc, command)   claim/<n>: one node per rank
    plan          node 0: the attempt number and the workers' store (or why the round is refused)
                  planned/<n>: the plan was read (a refused round's node 0 waits for it)
    alive/<n>     each node: a counter a thread bumps; a node silent for --node-timeout is lost
    interrupt     the first node to see a failure, a hang, a lost node or a stop signal (first wins)
    stop/<n>      each node, once asked to stop: where its ranks are; every node computes the
                  same stop step from all of them
    progress/<n>  each follower, every few seconds: its ranks' steps, for node 0's progress.json
    report/<n>    each node: how the attempt ended there, its failures
    verdict       node 0: restart, or end the job with an exit code   ack/<n>: the verdict was read

Every call that reaches the store of another machine may find it gone: a follower then gets
``LeaderUnreachable`` (node 0 died), and treats it as the end of the attempt.
"""

import dataclasses
import enum
import json
import math
import os
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from launcher.cluster.rendezvous import LeaderUnreachable
from launcher.config import LaunchConfig
from launcher.errors import UsageError
from launcher.failures import Failure, NodeLostFailure, failure_from_json, failure_to_json

__all__ = [
    "AttemptChannel",
    "AttemptPlan",
    "Interrupt",
    "InterruptKind",
    "JobVerdict",
    "NodeInfo",
    "NodeReport",
]

_BEAT_EVERY_S = 0.5  # liveness counter bumps (a thread); watchers look as often
_POLL_S = 0.05
# How long the stop request may take to reach every node's ranks, in seconds of stepping: the
# stop step is this far (at the fastest rank's pace) past the furthest step any rank reported.
STOP_PROPAGATION_S = 2.0


def _clock_offset() -> float:
    return time.time() - time.monotonic()


class InterruptKind(str, enum.Enum):
    FAILURE = "failure"  # a rank crashed or hung on that node
    STOP = "stop"  # a signal (preemption, Ctrl+C) reached that node
    LOST = "lost"  # a node's supervisor went silent


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

    @classmethod
    def of(cls, config: LaunchConfig) -> "NodeInfo":
        return cls(config.node_rank, socket.gethostname(), os.getpid(), config.nproc, list(config.command))


@dataclasses.dataclass(frozen=True)
class AttemptPlan:
    attempt: int
    master_addr: str
    master_port: int
    refused: str = ""  # node 0 refuses the round (nodes disagree): the reason, for every node


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """How one attempt ended on one node (failures with their log tails already attached)."""

    node: int
    outcome: str  # AttemptOutcome value
    failures: List[Failure]
    beat: bool
    furthest_step: Optional[int]
    signum: Optional[int] = None

    def to_json(self) -> str:
        return _dump_with_failures(self)

    @classmethod
    def from_json(cls, text: str) -> "NodeReport":
        return _load_with_failures(cls, text)


@dataclasses.dataclass(frozen=True)
class JobVerdict:
    """Node 0's decision after an attempt, for every node."""

    restart: bool
    exit_code: int
    status: str  # RunStatus value (when the job ends)
    reason: str
    outcome: str  # the job's AttemptOutcome for this attempt
    failures: List[Failure]  # every node's
    same_round: bool = False  # restart: the same nodes hold the next attempt on this round

    def to_json(self) -> str:
        return _dump_with_failures(self)

    @classmethod
    def from_json(cls, text: str) -> "JobVerdict":
        return _load_with_failures(cls, text)


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


class _Beater(threading.Thread):
    """Bumps this node's liveness counter from a thread: a main loop busy stopping workers or
    writing run.json for a few seconds must not look like a dead node."""

    def __init__(self, store, key: str) -> None:
        super().__init__(name="ftlaunch-node-alive", daemon=True)
        self._store, self._key = store, key
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - node 0 gone: the main loop finds out and says so
                return
            self._done.wait(_BEAT_EVERY_S)

    def stop(self) -> None:
        self._done.set()


class AttemptChannel:
    """One node's view of one attempt's round. Node 0 watches every other node; the others
    watch node 0."""

    def __init__(self, store, config: LaunchConfig) -> None:
        self._store = store
        self._config = config
        self.node = config.node_rank
        self._nodes = range(config.nnodes)
        self.broken: Optional[str] = None  # why node 0 cannot be reached, once it cannot
        watched = [n for n in self._nodes if n != self.node] if config.leads else [0]
        now = time.monotonic()
        self._seen: Dict[int, tuple] = {n: (-1, now) for n in watched}  # node → (counter, since)
        self._next_look = now
        self._interrupt: Optional[Interrupt] = None
        self._lost: Dict[int, float] = {}  # node → seconds silent when declared lost
        self._infos: Dict[int, NodeInfo] = {}
        self._answered_stop = False
        self._beater = _Beater(store, f"alive/{self.node}")
        self._beater.start()

    def close(self) -> None:
        self._beater.stop()

    # -- store access: a follower that loses node 0 gets LeaderUnreachable --------------------

    def _call(self, method: str, *args):
        if self.broken:
            raise LeaderUnreachable(self.broken)
        try:
            return getattr(self._store, method)(*args)
        except Exception as err:  # noqa: BLE001 - torch's DistError family, by any name
            if self._config.leads:
                raise  # node 0's store is in this process: an error here is a bug, not a loss
            self.broken = f"node 0's store at {self._config.rdzv_endpoint} is gone ({type(err).__name__})"
            raise LeaderUnreachable(self.broken) from None

    def _has(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def _get(self, key: str) -> str:
        return self._call("get", key).decode()

    # -- joining ---------------------------------------------------------------------------------

    def announce(self) -> None:
        """Say who this node is; two nodes with one rank are refused (by the second to claim)."""
        if self._call("add", f"claim/{self.node}", 1) > 1:
            raise UsageError(f"two nodes were started with --node-rank {self.node}: each node needs its own")
        info = NodeInfo.of(self._config)
        self._call("set", f"node/{self.node}", json.dumps(dataclasses.asdict(info)))

    def node_infos(self, wait: Callable[[float], None]) -> Dict[int, NodeInfo]:
        """Node 0: every node's announcement (each joined the round, so each is coming)."""
        self._wait_all("node", wait)  # a node lost on the way fails the attempt at its first tick
        self._infos = {
            n: NodeInfo(**json.loads(self._get(f"node/{n}"))) for n in self._nodes if self._has(f"node/{n}")
        }
        return self._infos

    def publish_plan(self, plan: AttemptPlan) -> None:
        self._call("set", "plan", json.dumps(dataclasses.asdict(plan)))

    def read_plan(self, wait: Callable[[float], None]) -> AttemptPlan:
        self._wait_for("plan", wait)
        plan = AttemptPlan(**json.loads(self._get("plan")))
        self._call("set", f"planned/{self.node}", "1")
        return plan

    # -- while the attempt runs ------------------------------------------------------------------

    def tick(self) -> Optional[Interrupt]:
        """Looked at on every turn of the monitor loop: has any node interrupted the attempt, or
        gone silent? A follower that loses node 0 gets an interrupt of its own making."""
        if self._interrupt is not None:
            return self._interrupt
        try:
            if self._has("interrupt"):
                self._interrupt = Interrupt.from_json(self._get("interrupt"))
                return self._interrupt
            lost = self._look_for_lost_nodes()
        except LeaderUnreachable as err:
            self._interrupt = Interrupt(0, InterruptKind.LOST, str(err))
            return self._interrupt
        if lost is not None:
            return self.interrupt(lost)
        return None

    def interrupt(self, interrupt: Interrupt) -> Interrupt:
        """Raise ``interrupt`` for every node, unless another node was first; returns the one in force."""
        if self._interrupt is not None:
            return self._interrupt
        try:
            self._call("compare_set", "interrupt", "", interrupt.to_json())
            self._interrupt = Interrupt.from_json(self._get("interrupt"))
        except LeaderUnreachable:
            self._interrupt = interrupt
        return self._interrupt

    @property
    def interrupted_by(self) -> Optional[Interrupt]:
        return self._interrupt

    def _look_for_lost_nodes(self) -> Optional[Interrupt]:
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + _BEAT_EVERY_S
        for node, (counter, since) in list(self._seen.items()):
            value = self._call("add", f"alive/{node}", 0)
            if value != counter:
                self._seen[node] = (value, now)
            elif now - since >= self._config.node_timeout and node not in self._lost:
                self._lost[node] = now - since
                if node == 0:
                    self.broken = f"node 0 has been silent for {now - since:.1f} s (--node-timeout)"
                    raise LeaderUnreachable(self.broken)
                return Interrupt(self.node, InterruptKind.LOST, f"node {node} silent for {now - since:.1f} s")
        return None

    def lost_failures(self) -> List[Failure]:
        """Node 0: the nodes declared lost, as failures."""
        return [
            NodeLostFailure(
                node=n,
                host=self._infos[n].host if n in self._infos else "?",
                pid=self._infos[n].pid if n in self._infos else 0,
                silent_for=silent,
                observed_at=time.monotonic(),
            )
            for n, silent in sorted(self._lost.items())
        ]

    # -- progress, for `ftlaunch status` --------------------------------------------------------

    def share_progress(self, rows: List[dict]) -> None:
        """A follower: its ranks' steps and beat ages, for node 0 to publish."""
        try:
            self._call("set", f"progress/{self.node}", json.dumps({"at": time.time(), "rows": rows}))
        except LeaderUnreachable:
            pass  # the next tick says so and ends the attempt

    def members(self) -> List[dict]:
        """Node 0, once every node announced itself: who runs this attempt, for run.json."""
        return [{"node": i.node, "host": i.host, "pid": i.pid} for _, i in sorted(self._infos.items())]

    def job_progress(self, own: List[dict]) -> Tuple[List[dict], List[dict]]:
        """Node 0: every rank's row, with its node (a follower's as of its last share, its beat
        ages brought up to now), and every node's supervisor: host, pid, seconds since its
        liveness counter last moved."""
        now, wall = time.monotonic(), time.time()
        ranks, nodes = [], []
        for n in self._nodes:
            rows, silent = own, 0.0
            if n != self.node:
                silent = now - self._seen[n][1]
                shared = json.loads(self._get(f"progress/{n}")) if self._has(f"progress/{n}") else None
                rows = [_aged(row, wall - shared["at"]) for row in shared["rows"]] if shared else []
            ranks += [{**row, "node": n} for row in rows]
            info = self._infos.get(n)
            nodes.append(
                {
                    "node": n,
                    "host": info.host if info else None,
                    "pid": info.pid if info else None,
                    "silent_for": round(silent, 1),
                    "lost": n in self._lost,
                }
            )
        return ranks, nodes

    # -- a stop step every rank of every node agrees on ---------------------------------------

    def agree_stop_step(self, reading: Optional[dict], wait: Callable[[float], None]) -> int:
        """Publish this node's ``reading`` ({"aware", "furthest", "rate"}; None: it has no running
        rank) and compute, from every node's, the step all ranks stop at; 0: none (a rank cannot
        be asked, or a node did not answer within --node-timeout)."""
        mine = reading or {"aware": True, "furthest": -1, "rate": 0.0}
        self._answered_stop = True
        try:
            self._call("set", f"stop/{self.node}", json.dumps(mine))
            if not self._wait_all("stop", wait, limit=self._config.node_timeout):
                return 0
            readings = [json.loads(self._get(f"stop/{n}")) for n in self._nodes]
        except LeaderUnreachable:
            return 0
        return stop_step(readings)

    def answer_stop_if_asked(self) -> None:
        """A node with no running rank (done, or waiting for the verdict) still answers a stop
        request, so that the others need not wait for it."""
        interrupt = self.tick()
        if interrupt is not None and interrupt.kind is InterruptKind.STOP and not self._answered_stop:
            self._answered_stop = True
            self._call("set", f"stop/{self.node}", json.dumps({"aware": True, "furthest": -1, "rate": 0.0}))

    # -- the end of the attempt --------------------------------------------------------------------

    def report(self, report: NodeReport) -> None:
        self._call("set", f"report/{self.node}", report.to_json())

    def gather(self, wait: Callable[[float], None]) -> List[NodeReport]:
        """Node 0: every node's report; a node that goes silent before reporting is lost (and
        the attempt interrupted for the others)."""
        reports: Dict[int, NodeReport] = {}
        while True:
            for n in self._nodes:
                if n not in reports and n not in self._lost and self._has(f"report/{n}"):
                    reports[n] = NodeReport.from_json(self._get(f"report/{n}"))
            if all(n in reports or n in self._lost for n in self._nodes):
                return [reports[n] for n in sorted(reports)]
            self.answer_stop_if_asked()
            wait(_POLL_S)

    def publish_verdict(self, verdict: JobVerdict) -> None:
        self._call("set", "verdict", verdict.to_json())

    def await_verdict(self, wait: Callable[[float], None]) -> JobVerdict:
        """A follower: node 0's decision (LeaderUnreachable when node 0 goes silent first)."""
        while not self._has("verdict"):
            self.answer_stop_if_asked()
            wait(_POLL_S)
        verdict = JobVerdict.from_json(self._get("verdict"))
        self._call("set", f"ack/{self.node}", "1")
        return verdict

    def await_acks(self, wait: Callable[[float], None], key: str = "ack") -> None:
        """Node 0, before its store goes away with it: every live node has read what it said
        last (the verdict: ``ack``; a refused plan: ``planned``)."""
        live = [n for n in self._nodes if n != self.node and n not in self._lost]
        deadline = time.monotonic() + self._config.node_timeout
        while time.monotonic() < deadline and not all(self._has(f"{key}/{n}") for n in live):
            wait(_POLL_S)

    # -- waiting -----------------------------------------------------------------------------------

    def _wait_for(self, key: str, wait: Callable[[float], None]) -> None:
        """A follower: until node 0 sets ``key`` (LeaderUnreachable when it goes silent first)."""
        while not self._has(key):
            self._look_for_lost_nodes()
            wait(_POLL_S)

    def _wait_all(self, prefix: str, wait: Callable[[float], None], limit: Optional[float] = None) -> bool:
        """Until every node has set ``prefix/<n>``; False when ``limit`` seconds pass first or a
        node is lost on the way."""
        deadline = None if limit is None else time.monotonic() + limit
        while not all(self._has(f"{prefix}/{n}") for n in self._nodes):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            lost = self._look_for_lost_nodes()
            if lost is not None:
                self.interrupt(lost)
            if self._lost:
                return False
            wait(_POLL_S)
        return True


def _aged(row: dict, seconds: float) -> dict:
    silent = row.get("silent_for")
    return {**row, "silent_for": None if silent is None else round(silent + seconds, 3)}


def stop_step(readings: List[dict]) -> int:
    """The step every rank stops at: past the furthest any rank has reached, by a margin that
    covers the time the request takes to reach every rank at the fastest rank's pace. 0: some
    node has a rank that never calls ft.should_stop (it would leave the others in a collective)."""
    if not readings or not all(r["aware"] for r in readings):
        return 0
    furthest = max(r["furthest"] for r in readings)
    fastest = max(float(r["rate"]) for r in readings)
    if furthest < 0:
        return 0
    return furthest + 2 + math.ceil(fastest * STOP_PROPAGATION_S)
