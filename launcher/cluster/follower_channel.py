"""A follower's end of an attempt's keys: it watches only node 0, reads the plan and the
verdict, and loses the attempt (``LeaderUnreachable``) when node 0's store goes away or node 0
goes silent."""

import json
import time
from typing import Callable, Dict, List, Optional, Tuple

from launcher.cluster.alive import AliveCounter, look_every
from launcher.cluster.channel import AttemptChannel, ChannelSpec
from launcher.cluster.deadline_store import DeadlineStore
from launcher.cluster.rendezvous import WATCH_EVERY_S, LeaderUnreachable
from launcher.cluster.store_errors import leader_gone
from launcher.cluster.wire import Interrupt, JobVerdict, RoundPlan
from launcher.core.beats import ProgressRow, ProgressShare
from launcher.process.signals import SignalInbox

__all__ = ["FollowerChannel"]

# A beat not under way and this many beats late: this process did not run (its counter is read).
_LATE_BEATS = 1.5
# This loop not run for this long (stopped, or busy stopping ranks): no judgement for _SETTLE_S.
_AWAY_S, _SETTLE_S = 2.0, 1.0


class FollowerChannel(AttemptChannel):
    def __init__(
        self, store, spec: ChannelSpec, signals: SignalInbox, beater: Optional[AliveCounter] = None
    ) -> None:
        """``beater``: the claim's counter (``lobby.NodeClaim``), which node 0 watches: one beat a
        supervisor, not one for the lobby and one for the attempt (issue 48 item 8)."""
        super().__init__(store, spec, signals, watched=[0], beater=beater)
        self._looked = time.monotonic()  # this loop's last judgement of node 0
        self._judge_from = 0.0
        self._heard = 0.0  # node 0's last answer to a look of this loop's (its beat's: the beater's)
        self._said: Tuple[tuple, ...] = ()  # the rows of the last share, as ``_as_said`` puts them
        self.broken = ""  # why node 0 cannot be reached, once it cannot

    def _silences(self) -> Dict[int, float]:
        """Node 0 hosts the store this node's beat goes to: node 0 is heard through its beats'
        answers, with no request of ours. Its silence counts from the beat it has not answered
        (from when it was sent), not from the last answer: node 0 may have stopped just after that
        answer or just before the next beat, so only a request sent and never answered proves a
        silence. Node 0 found lost was then silent for --node-timeout at least, which its own
        witness relies on (``LeaderChannel.own_stall``: a node 0 stopped a beat short of the
        timeout was found lost, and blamed the follower that left it). A beat that is late
        without being under way means this process did not run (stopped, starved): a look of this
        loop's asks node 0's store then, and its answer is node 0 heard. Back from such a gap,
        this loop judges nothing for a moment: the beat thread first reads the answer that may
        have come meanwhile."""
        now = time.monotonic()
        if now - self._looked >= _AWAY_S:
            self._judge_from = now + _SETTLE_S
        self._looked = now
        beater = self._beater
        if 0 in self._lost:
            return {}
        late = beater.asking is None and now - beater.bumped >= _LATE_BEATS * beater.every
        if late and now >= self._next_look:
            self._next_look = now + look_every(self.spec.node_timeout)
            self._call("check", ["interrupt"])  # its beat did not run: any answer is node 0 heard
            self._heard = time.monotonic()
        heard = max(beater.bumped, self._heard, beater.asking or 0.0)
        return {0: now - heard if now >= self._judge_from else 0.0}

    def _for_calls(self, store, spec: ChannelSpec):
        """Node 0's store, each call with a deadline of --node-timeout (a stopped node 0 is lost,
        not waited for with no end), or a shorter one once a signal came."""
        return DeadlineStore(store, spec.node_timeout, self._signals)

    def close(self) -> None:
        super().close()
        self._store.close()

    def _call(self, method: str, *args):
        if self.broken:
            raise LeaderUnreachable(self.broken)
        return super()._call(method, *args)

    def _store_failed(self, err: Exception) -> None:
        """Node 0 gone: the attempt is lost with it. Any other error is a defect, raised as it is."""
        if not leader_gone(err):
            return
        self.broken = f"node 0's store at {self.spec.endpoint} is gone ({type(err).__name__}: {err})"
        raise LeaderUnreachable(self.broken) from None

    def _declare_lost(self, node: int, why: str) -> Interrupt:
        self.broken = f"node 0 has been {why} (--node-timeout)"
        raise LeaderUnreachable(self.broken)

    def read_plan(self, limit: float, watch: Callable[[], None] = lambda: None) -> RoundPlan:
        """Node 0's plan for the attempt; any signal ends the wait (SignalReceived), and so does
        an error raised by ``watch``, called every half second meanwhile."""
        wait = self._wait(limit, since=0)
        while not self._has("plan"):
            if wait.due(WATCH_EVERY_S, "watch", first=0):
                watch()
            self._look_for_lost_nodes()
            if wait.expired:
                self.broken = f"node 0 planned no attempt within {limit:g} s"
                raise LeaderUnreachable(self.broken)
            wait.pause()
        plan = RoundPlan(**json.loads(self._get("plan")))
        self._say_done("planned")
        if plan.nodes and not plan.refused:
            self.set_nodes(plan.nodes)
        return plan

    def share_progress(self, rows: List[ProgressRow]) -> None:
        """Its ranks' steps and beat ages, for node 0 to publish; not again while they say what
        the last share said (node 0 ages a share's rows from its time: the same rows)."""
        now = time.time()
        said = _as_said(rows, now)
        if said == self._said:
            return
        shared = ProgressShare(now, rows)
        try:
            self._call("set", f"progress/{self.node}", json.dumps(shared.to_json()))
            self._said = said
        except LeaderUnreachable:
            pass  # the next tick says so and ends the attempt

    def await_verdict(self, limit: float) -> JobVerdict:
        """Node 0's decision: LeaderUnreachable when node 0 goes silent first or decides nothing
        within ``limit`` seconds; SignalReceived by a signal the attempt did not act on (one that
        came while this node's ranks stopped, or during this wait)."""
        wait = self._wait(limit, since=self._signals.answered)
        while not self._has("verdict"):
            self.answer_stop_if_asked()
            self._look_for_lost_nodes()
            if wait.expired:
                self.broken = f"node 0 gave no verdict within {limit:g} s"
                raise LeaderUnreachable(self.broken)
            wait.pause()
        verdict = JobVerdict.from_json(self._get("verdict"))
        self._say_done("acked")
        return verdict


def _as_said(rows: List[ProgressRow], wall: float) -> Tuple[tuple, ...]:
    """What ``rows`` say, read at ``wall``: each silence as the moment it began (to a tenth of a
    second), so that rows that only grew older compare equal."""
    return tuple(
        (r.rank, r.pid, r.step, r.phase, None if r.silent_for is None else round(wall - r.silent_for, 1))
        for r in rows
    )
