"""A follower's end of an attempt's keys: it watches only node 0, reads the plan and the
verdict, and loses the attempt (``LeaderUnreachable``) when node 0's store goes away or node 0
goes silent."""

import json
import time
from typing import Callable, List, NoReturn

from launcher.cluster.channel import AttemptChannel, ChannelSpec
from launcher.cluster.deadline_store import DeadlineStore
from launcher.cluster.rendezvous import WATCH_EVERY_S, LeaderUnreachable
from launcher.cluster.wire import Interrupt, JobVerdict, RoundPlan
from launcher.core.beats import ProgressRow
from launcher.process.signals import SignalInbox

__all__ = ["FollowerChannel"]


class FollowerChannel(AttemptChannel):
    def __init__(self, store, spec: ChannelSpec, signals: SignalInbox) -> None:
        super().__init__(store, spec, signals, watched=[0])
        self.broken = ""  # why node 0 cannot be reached, once it cannot

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

    def _store_failed(self, err: Exception) -> NoReturn:
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
        """Its ranks' steps and beat ages, for node 0 to publish."""
        shared = {"at": time.time(), "rows": [row.to_json() for row in rows]}
        try:
            self._call("set", f"progress/{self.node}", json.dumps(shared))
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
