"""Node 0's end of an attempt's keys: it meets every node, plans the attempt, gathers how it
ended everywhere, and tells every node its verdict."""

import dataclasses
import json
import logging
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from launcher.cluster.alive import AliveCounter, beat_every, look_every
from launcher.cluster.channel import AttemptChannel, ChannelSpec
from launcher.cluster.lobby import ALIVE_PREFIX, claimed_counters
from launcher.cluster.rendezvous import WATCH_EVERY_S, RoundFailed
from launcher.cluster.wire import Interrupt, JobVerdict, NodeInfo, NodeReport, RoundPlan
from launcher.core.beats import CopyReading, NodeRow, ProgressRow, ProgressShare
from launcher.core.failures import NodeLostFailure
from launcher.grammar.errors import SignalReceived
from launcher.process.signals import SignalInbox

__all__ = ["LeaderChannel"]

Gone = Callable[[str], Optional[float]]

# A node whose liveness counter has not moved for this many of its beats is not waited for to read
# the verdict (its supervisor died), even within --node-timeout.
_GONE_BEATS = 3

log = logging.getLogger(__name__)


class LeaderChannel(AttemptChannel):
    def __init__(
        self, store, spec: ChannelSpec, signals: SignalInbox, job_store=None, gone: Gone = lambda _: None
    ) -> None:
        """``job_store``: the lobby's store, where a follower's claim counter is the one watched
        (None: ``alive/<n>`` here); ``gone``: when the connection of a claim's token to node 0
        ended (``cluster.gone``; None: open)."""
        # No node is watched before it announces itself: nothing here is sized by --nnodes MAX.
        super().__init__(store, spec, signals, watched=[])
        self._job_store = job_store
        self._claim_counters: Dict[int, str] = {}  # node → its claim's counter in the job store
        self._infos: Dict[int, NodeInfo] = {}
        self._lost_at: Dict[int, float] = {}  # node → when it was declared lost (monotonic)
        self._unreported: Dict[int, float] = {}  # node → the report deadline it beat through
        self._garbled: Set[int] = set()  # nodes whose progress share was damaged (said once)
        self._standby: Tuple[int, ...] = ()  # the attempt's standby nodes: watched, never waited for
        self.standbys_lost: Dict[int, str] = {}  # standby → why it was found lost (the attempt goes on)
        self._gone = gone
        self._closed: Set[int] = set()  # nodes found lost by their connection's end

    def node_infos(
        self, count: int, limit: float, watch: Callable[[], None] = lambda: None
    ) -> Dict[int, NodeInfo]:
        """The announcements of all ``count`` nodes of the round, which are then the only ones
        watched. One missing after ``limit`` died on the way: RoundFailed, and every node meets
        again. A signal or an error from ``watch`` (every half second) ends the wait."""
        wait = self._wait(limit, since=0)
        while True:
            if wait.due(WATCH_EVERY_S, "watch", first=0):
                watch()
            present = self._listed("nodes")
            if len(present) >= count:
                break
            if wait.expired:
                raise RoundFailed(
                    f"{count - len(present)} of the round's {count} nodes did not announce itself within "
                    f"{limit:g} s (only node(s) {', '.join(map(str, present))} did)"
                )
            wait.pause()
        texts = self._call("multi_get", [f"node/{n}" for n in present])
        self._infos = {n: NodeInfo(**json.loads(t)) for n, t in zip(present, texts)}
        self.set_nodes(present)
        watched = [n for n in present if n != self.node]
        if self._job_store is not None and watched:
            self._claim_counters = claimed_counters(self._job_store, watched)
        now = time.monotonic()
        self._seen = {n: (-1, now) for n in watched}
        return self._infos

    def set_standby(self, standby: Tuple[int, ...]) -> None:
        """The plan's standby nodes: no rank of theirs is waited for (a report, a stop step), and
        one found lost ends nothing; each still reads the verdict before this store goes away."""
        self._standby = tuple(standby)
        self.set_nodes([n for n in self._nodes if n not in standby])

    @property
    def standby(self) -> Tuple[int, ...]:
        return self._standby

    def _look_for_lost_nodes(self) -> Optional[Interrupt]:
        """As every node looks, and at once for a node whose supervisor's connection ended; a
        standby found lost is only noted (``standbys_lost``)."""
        for node, silent in self._silences().items():
            closed = self._closed_at(node) is not None
            if silent < self.spec.node_timeout and not closed:
                continue
            why = "gone (its connection to node 0 closed)" if closed else f"silent for {silent:.1f} s"
            if node not in self._standby:
                if closed:
                    self._closed.add(node)
                return self._declare_lost(node, why)
            del self._seen[node]
            self.standbys_lost[node] = f"standby node {node} {why}"
        return None

    def _closed_at(self, node: int) -> Optional[float]:
        counter = self._claim_counters.get(node, "")
        return self._gone(counter[len(ALIVE_PREFIX) :]) if counter.startswith(ALIVE_PREFIX) else None

    def _make_beater(self, store, spec: ChannelSpec) -> AliveCounter:
        """Node 0's witness of its own process only: followers hear node 0 through their beats'
        answers, so nobody reads a counter of its."""
        return AliveCounter(None, f"alive/{self.node}", look_every(spec.node_timeout))

    def _counters(self, nodes: List[int]) -> Dict[int, int]:
        """Each node's claim counter (one call for all); one without a claim: ``alive/<n>``."""
        claimed = [n for n in nodes if n in self._claim_counters]
        found: Dict[int, int] = {}
        if claimed:
            keys = [self._claim_counters[n] for n in claimed]
            values = self._job_call("multi_get", keys)
            found = {n: int(value) for n, value in zip(claimed, values)}
        rest = [n for n in nodes if n not in found]
        return {**found, **(super()._counters(rest) if rest else {})}

    def _job_call(self, method: str, *args):
        assert self._job_store is not None
        return getattr(self._job_store, method)(*args)

    def publish_plan(self, plan: RoundPlan) -> None:
        self._call("set", "plan", json.dumps(plan.__dict__))

    def members(self) -> List[dict]:
        """Once every node announced itself: who runs this attempt, for run.json."""
        return [{"node": i.node, "host": i.host, "pid": i.pid} for _, i in sorted(self._infos.items())]

    def lost_failures(self) -> List[NodeLostFailure]:
        """The nodes declared lost, as failures; after this node's own stall (``left_by_all``) not
        those found silent since: they left node 0, the stall's doing (``own_stall``)."""
        after = self._beater.stalled_until if self.left_by_all else float("inf")
        return [
            NodeLostFailure(
                node=n,
                host=self._infos[n].host if n in self._infos else "?",
                pid=self._infos[n].pid if n in self._infos else 0,
                silent_for=self._silent_for(n),
                observed_at=time.monotonic(),
                unreported=self._unreported.get(n, 0.0),
                closed=n in self._closed,
            )
            for n in sorted(self._lost)
            if self._lost_at.get(n, 0.0) < after
        ]

    def _declare_lost(self, node: int, why: str) -> Interrupt:
        self._lost_at[node] = time.monotonic()
        return super()._declare_lost(node, why)

    @property
    def left_by_all(self) -> bool:
        """This process did not run for --node-timeout or more: every other node lost it and left
        the attempt, so none will report or read a verdict here."""
        return bool(self.own_stall())

    def _silences(self) -> Dict[int, float]:
        """As every node judges, but node 0 hosts the counters: while this process did not run no
        counter could move, so nobody is judged until its own witness has run again."""
        if self._beater.running_late:
            return {n: 0.0 for n in self._seen if n not in self._lost}
        until = self._beater.stalled_until
        self._seen = {n: (counter, max(since, until)) for n, (counter, since) in self._seen.items()}
        return super()._silences()

    def own_stall(self) -> List[NodeLostFailure]:
        """This node, when its process did not run for --node-timeout: the blame is its own."""
        stalled = self._beater.stalled
        if stalled + self._beater.every < self.spec.node_timeout:  # its last bump came a beat before
            return []
        info = self._infos.get(self.node)
        host, pid = (info.host, info.pid) if info else ("?", 0)
        at = self._beater.stalled_until
        return [
            NodeLostFailure(
                node=self.node, host=host, pid=pid, silent_for=round(stalled, 1), observed_at=at, stalled=True
            )
        ]

    def _silent_for(self, node: int) -> float:
        return round(time.monotonic() - self._seen[node][1], 3) if node in self._seen else 0.0

    # -- progress, for `ftlaunch status` --------------------------------------------------------

    def job_progress(
        self, own: List[ProgressRow], own_copies: Optional[CopyReading] = None
    ) -> Tuple[List[ProgressRow], List[NodeRow]]:
        """Every rank's row (a follower's from its last share, aged to now) and every node's
        supervisor: host, pid, seconds since its counter moved, its copies on other nodes."""
        wall = time.time()
        others = [n for n in self._nodes if n != self.node]
        texts = self._call("multi_get", [f"progress/{n}" for n in others]) if others else []
        shares = dict(zip(others, texts))  # one call for every node
        ranks, nodes = [], []
        for n in self._nodes:
            rows, silent, copies = own, 0.0, own_copies
            if n != self.node:
                silent, shared = self._silent_for(n), self._share(n, shares[n])
                rows, copies = [row.aged(wall - shared.at) for row in shared.rows], shared.copies
            ranks += [dataclasses.replace(row, node=n) for row in rows]
            info = self._infos.get(n)
            host, pid = (info.host, info.pid) if info else (None, None)
            copied = copies.copied if copies is not None and copies.copied >= 0 else None
            lag = copies.lag if copies is not None else None
            nodes.append(NodeRow(n, host, pid, round(silent, 1), n in self._lost, copied, lag))
        return ranks, nodes

    def _share(self, node: int, text: bytes) -> ProgressShare:
        """A follower's share; a damaged one is said once and shows no ranks (only ``status``
        reads it)."""
        try:
            return ProgressShare.from_json(json.loads(text))
        except (ValueError, TypeError, KeyError) as err:
            if node not in self._garbled:
                self._garbled.add(node)
                log.warning("node %d's progress share is damaged (%s); its ranks are left out", node, err)
            return ProgressShare(0.0, [])

    # -- the end of the attempt --------------------------------------------------------------------

    def gather(self, limit: float) -> List[NodeReport]:
        """Every node's report; a node silent, or beating with no report after ``limit``, is
        lost. A signal the attempt did not act on ends the wait with the reports so far."""
        wait = self._wait(limit, since=self._signals.answered)
        reports: Dict[int, NodeReport] = {}
        while True:
            new = [n for n in self._listed("reported") if n in self._nodes and n not in reports]
            texts = self._call("multi_get", [f"report/{n}" for n in new]) if new else []
            reports.update((n, NodeReport.from_json(text.decode())) for n, text in zip(new, texts))
            missing = [n for n in self._nodes if n not in reports and n not in self._lost]
            if not missing or self.left_by_all:
                break
            if wait.expired:
                for n in missing:
                    self._unreported[n] = limit
                    self._declare_lost(n, f"sent no report within {limit:g} s of the attempt's end")
                break
            self.answer_stop_if_asked()  # and looks for lost nodes
            try:
                wait.pause()
            except SignalReceived:
                break
        return [reports[n] for n in sorted(reports)]

    def publish_verdict(self, verdict: JobVerdict) -> None:
        self._call("set", "verdict", verdict.to_json())

    def await_acks(self, key: str = "acked") -> None:
        """Before node 0's store goes away: wait (--node-timeout at most) until every live node
        has read what it said last (``acked``, or ``planned`` for a refused plan). A node whose
        counter stands still is not waited for; a signal ends the wait."""
        if self.left_by_all:
            return
        every = [*self._nodes, *(n for n in self._standby if n not in self.standbys_lost)]
        waiting = {n for n in every if n != self.node and n not in self._lost}
        wait = self._wait(self.spec.node_timeout)
        try:
            while waiting and not wait.expired:
                silences, read = self._silences(), set(self._listed(key))
                gone = _GONE_BEATS * beat_every(self.spec.node_timeout)
                waiting = {n for n in waiting if n not in read and silences[n] < gone}
                wait.pause()
        except SignalReceived:
            pass
