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
from launcher.core.beats import CopyReading, ProgressRow, ProgressShare
from launcher.process.signals import SignalInbox

__all__ = ["FollowerChannel"]

# A beat not under way and this many beats late: this process did not run (its counter is read).
_LATE_BEATS = 1.5
# This loop not run for this long (stopped, or busy stopping ranks): no judgement for _SETTLE_S.
_AWAY_S, _SETTLE_S = 2.0, 1.0
# A standby looks for node 0's verdict this often (a restart's comes after an interrupt it sees at once).
_VERDICT_LOOK_S = 0.5


class FollowerChannel(AttemptChannel):
    def __init__(
        self, store, spec: ChannelSpec, signals: SignalInbox, beater: Optional[AliveCounter] = None
    ) -> None:
        """``beater``: the claim's counter (``lobby.NodeClaim``): one beat a supervisor."""
        super().__init__(store, spec, signals, watched=[0], beater=beater)
        self._looked = time.monotonic()  # this loop's last judgement of node 0
        self._judge_from = 0.0
        self._heard = 0.0  # node 0's last answer to a look of this loop's (its beat's: the beater's)
        self._said: tuple = ()  # the rows (as ``_as_said`` puts them) and copies of the last share
        self.broken = ""  # why node 0 cannot be reached, once it cannot
        self._next_verdict_look = 0.0

    def _silences(self) -> Dict[int, float]:
        """Node 0 is heard through the answers to this node's beats. Its silence counts from the
        beat it has not answered, not from the last answer, so node 0 found lost was silent for
        --node-timeout at least (``LeaderChannel.own_stall`` relies on it: else node 0 stopped a
        beat short blamed the follower). A beat late and not under way means this process did
        not run: this loop asks the store itself, and judges nothing for ``_SETTLE_S``."""
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
        """Node 0's store, each call with a deadline: --node-timeout, shorter once a signal came."""
        return DeadlineStore(store, spec.node_timeout, self._signals)

    def close(self, quietly: bool = False) -> None:
        super().close(quietly)
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
        """Node 0's plan; a signal (SignalReceived) or an error from ``watch`` ends the wait."""
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

    def share_progress(self, rows: List[ProgressRow], copies: Optional[CopyReading] = None) -> None:
        """Its ranks' steps and beat ages (and its copies), for node 0 to publish; not again while
        unchanged."""
        now = time.time()
        said = (_as_said(rows, now), copies)
        if said == self._said:
            return
        shared = ProgressShare(now, rows, copies)
        try:
            self._call("set", f"progress/{self.node}", json.dumps(shared.to_json()))
            self._said = said
        except LeaderUnreachable:
            pass  # the next tick says so and ends the attempt

    def decided(self) -> bool:
        """Whether node 0's verdict is out (looked at every ``_VERDICT_LOOK_S``): a standby's
        attempt ends there, since no failure or interrupt need come before a success."""
        now = time.monotonic()
        if now < self._next_verdict_look:
            return False
        self._next_verdict_look = now + _VERDICT_LOOK_S
        try:
            return self._has("verdict")
        except LeaderUnreachable:
            return True  # the next call says so: conclude() finds node 0 gone

    def await_verdict(self, limit: float) -> JobVerdict:
        """Node 0's decision: LeaderUnreachable when node 0 is silent or decides nothing within
        ``limit``; SignalReceived by a signal the attempt did not act on."""
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
    """``rows`` with each silence as the moment it began, so rows that only aged compare equal."""
    return tuple(
        (r.rank, r.pid, r.step, r.phase, None if r.silent_for is None else round(wall - r.silent_for, 1))
        for r in rows
    )
