"""One node's end of one attempt's keys (``cluster.wire``): what every node does (beat, watch for
lost nodes, raise and read the interrupt, agree on a stop step); ``LeaderChannel`` and
``FollowerChannel`` add node 0's part and the others'. Every wait has a deadline, keeps looking
for lost nodes and answers signals."""

import dataclasses
import json
import time
from typing import Dict, List, Optional, Sequence

from launcher.cluster.alive import AliveCounter, beat_every, look_every
from launcher.cluster.rendezvous import LeaderUnreachable
from launcher.cluster.watch import KeyWatch
from launcher.cluster.wire import Interrupt, InterruptKind, reading_from_json, reading_to_json
from launcher.core.config import ClusterSection
from launcher.core.stopping import StopReading, stop_step
from launcher.grammar.errors import SignalReceived, UsageError
from launcher.process.signals import SignalInbox
from launcher.process.waiting import Wait

__all__ = ["AttemptChannel", "ChannelSpec"]

_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class ChannelSpec:
    """Who this node is among how many, and how long a silent node is given."""

    node: int
    nnodes: int
    node_timeout: float
    endpoint: str  # node 0's --rdzv-endpoint, for what a follower says when it is gone

    @classmethod
    def of(cls, cluster: ClusterSection) -> "ChannelSpec":
        return cls(cluster.node_rank, cluster.nnodes, cluster.node_timeout, cluster.rdzv_endpoint)


class AttemptChannel:
    """The part every node shares. ``watched``: the nodes whose liveness this node judges (node 0
    all others, the others node 0). Every node of the job is assumed until ``set_nodes``."""

    def __init__(
        self,
        store,
        spec: ChannelSpec,
        signals: SignalInbox,
        watched: List[int],
        beater: Optional[AliveCounter] = None,
    ) -> None:
        """``beater``: a counter this supervisor beats for its whole life (a follower's claim),
        left running; without one the channel beats ``alive/<node>`` itself."""
        self._signals = signals
        self._store = self._for_calls(store, spec)
        self.spec = spec
        self.node = spec.node
        self._nodes: Sequence[int] = range(spec.nnodes)  # lazy: nothing sized by the largest job
        now = time.monotonic()
        self._seen: Dict[int, tuple] = {n: (-1, now) for n in watched}  # node → (counter, since)
        self._next_look = now
        self._interrupt: Optional[Interrupt] = None
        self._lost: Dict[int, str] = {}  # node → why it was declared lost
        self._answered_stop = False
        self._own_beater = beater is None
        self._beater = beater or self._make_beater(store, spec)
        if self._own_beater:
            self._beater.start()
        self._watch = KeyWatch(store, "interrupt", signals.wake)
        self._watch.start()

    def close(self, quietly: bool = False) -> None:
        """Done with the attempt: raises an interrupt if none is in force, so that a node still
        running learns at once that this one left; ``quietly``: a node the attempt was planned
        without leaves it as it found it."""
        if not quietly and self._interrupt is None and not self._watch.fired:
            try:
                self.interrupt(Interrupt(self.node, InterruptKind.LOST, f"node {self.node} left the attempt"))
            except Exception:  # noqa: BLE001 - a store that is gone: the others find this node silent
                pass
        if self._own_beater:
            self._beater.stop()
        self._watch.stop()

    def set_nodes(self, nodes) -> None:
        """The nodes that hold the attempt (node 0's plan): those every wait here waits for."""
        self._nodes = tuple(nodes)

    def _make_beater(self, store, spec: ChannelSpec) -> AliveCounter:
        """This node's counter in the attempt's keys, bumped every beat."""
        return AliveCounter(store, f"alive/{self.node}", beat_every(spec.node_timeout))

    def _for_calls(self, store, spec: ChannelSpec):
        """The store as this node's main thread calls it (the liveness thread uses it as given)."""
        return store

    # -- store access ------------------------------------------------------------------------------

    def _call(self, method: str, *args):
        try:
            return getattr(self._store, method)(*args)
        except Exception as err:  # noqa: BLE001 - torch's DistError family, by any name
            self._store_failed(err)
            raise

    def _store_failed(self, err: Exception) -> None:
        """Node 0's store is in its own process: an error there is a bug, not a loss."""

    def _has(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def _get(self, key: str) -> str:
        return self._call("get", key).decode()

    def _say_done(self, key: str) -> None:
        """Append this node to the list ``key``: node 0 reads who did it in one call."""
        self._call("append", key, f"{self.node},")

    def _listed(self, key: str) -> List[int]:
        """The nodes in the list ``key`` so far, ascending."""
        if not self._has(key):
            return []
        return sorted({int(n) for n in self._get(key).split(",") if n})

    def report(self, report) -> None:
        """How the attempt ended on this node (a ``NodeReport``), for node 0."""
        self._call("set", f"report/{self.node}", report.to_json())
        self._say_done("reported")

    # -- while the attempt runs ------------------------------------------------------------------

    def tick(self) -> Optional[Interrupt]:
        """Each turn of the monitor loop: the interrupt in force, or a lost node's. Lost nodes are
        looked for even once interrupted (a node may die while the others stop); an interrupt
        seen this turn returns at once, the look (a round trip to a busy store) waits a turn."""
        try:
            if self._interrupt is None and self._interrupt_raised():
                self._interrupt = Interrupt.from_json(self._watch.value or self._get("interrupt"))
                return self._interrupt
            lost = self._look_for_lost_nodes()
        except LeaderUnreachable as err:
            if self._interrupt is None:
                self._interrupt = Interrupt(0, InterruptKind.LOST, str(err))
            return self._interrupt
        if lost is not None:
            return self.interrupt(lost)
        return self._interrupt

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

    def _interrupt_raised(self) -> bool:
        """Whether some node raised the interrupt: the watch's word, or our own look when the
        watch is broken."""
        return self._watch.fired or (self._watch.broken and self._has("interrupt"))

    def _look_for_lost_nodes(self) -> Optional[Interrupt]:
        """An interrupt for the first watched node silent for --node-timeout (None: none new)."""
        for node, silent in self._silences().items():
            if silent >= self.spec.node_timeout:
                return self._declare_lost(node, f"silent for {silent:.1f} s")
        return None

    def _silences(self) -> Dict[int, float]:
        """Each watched node not yet lost: seconds since its counter last moved (read at most
        every ``look_every``)."""
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + look_every(self.spec.node_timeout)
            for node, value in self._counters([n for n in self._seen if n not in self._lost]).items():
                if value != self._seen[node][0]:
                    self._seen[node] = (value, now)
        return {n: now - since for n, (_, since) in self._seen.items() if n not in self._lost}

    def _counters(self, nodes: List[int]) -> Dict[int, int]:
        """The liveness counters of ``nodes``, in one call (every node announced creates its own)."""
        if len(nodes) == 1:  # a follower's look at node 0, which may not have announced yet
            return {nodes[0]: int(self._call("add", f"alive/{nodes[0]}", 0))}
        values = self._call("multi_get", [f"alive/{n}" for n in nodes]) if nodes else []
        return {n: int(value) for n, value in zip(nodes, values)}

    def _declare_lost(self, node: int, why: str) -> Interrupt:
        self._lost[node] = why
        return Interrupt(self.node, InterruptKind.LOST, f"node {node} {why}")

    # -- a stop step every rank of every node agrees on ---------------------------------------

    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        """Publish this node's ``reading`` (None: no running rank) and compute from every node's
        the step all ranks stop at; 0: none (a rank cannot be asked, a node did not answer)."""
        self._answered_stop = True
        # SLURM signals every node at once: only a second signal (Ctrl+C again) ends the wait.
        since = max(1, len(self._signals.received))
        try:
            self._call("set", f"stop/{self.node}", reading_to_json(reading or StopReading.idle()))
            if not self._wait_all("stop", limit=self.spec.node_timeout, since=since):
                return 0
            readings = [reading_from_json(self._get(f"stop/{n}")) for n in self._nodes]
        except (LeaderUnreachable, SignalReceived):
            return 0
        return stop_step(readings)

    def answer_stop_if_asked(self) -> None:
        """A node with no running rank still answers a stop request, so nobody waits for it."""
        interrupt = self.tick()
        if interrupt is not None and interrupt.kind.asks_to_stop and not self._answered_stop:
            self._answered_stop = True
            self._call("set", f"stop/{self.node}", reading_to_json(StopReading.idle()))

    # -- waiting -----------------------------------------------------------------------------------

    def _wait(self, limit: float, since: Optional[int] = None) -> Wait:
        """``limit`` seconds, ended by a signal after the first ``since`` (default: any new one)."""
        return Wait(limit, self._signals, since=since, look=_POLL_S)

    def _wait_all(self, prefix: str, limit: float, since: Optional[int] = None) -> bool:
        """Until every node has set ``prefix/<n>``; False when ``limit`` passes first or a node is
        lost on the way."""
        wait = self._wait(limit, since)
        keys = [f"{prefix}/{n}" for n in self._nodes]
        while not self._call("check", keys):  # one round trip for every node's key
            if wait.expired:
                return False
            lost = self._look_for_lost_nodes()
            if lost is not None:
                self.interrupt(lost)
            if self._lost:
                return False
            wait.pause()
        return True

    # -- joining ---------------------------------------------------------------------------------

    def announce(self, info) -> None:
        """Say who this node is (a ``NodeInfo``); the second node to claim a rank is refused."""
        if self._call("add", f"claim/{self.node}", 1) > 1:
            raise UsageError(f"two nodes were started with --node-rank {self.node}: each node needs its own")
        self._call("set", f"node/{self.node}", json.dumps(dataclasses.asdict(info)))
        # Its counter and its progress are there before node 0 reads them (one multi_get each).
        self._call("add", f"alive/{self.node}", 0)
        self._call("set", f"progress/{self.node}", json.dumps({"at": time.time(), "rows": []}))
        self._say_done("nodes")
