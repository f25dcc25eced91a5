"""Node 0's side of the lobby while the nodes meet: a stop any node asked for, nodes that came
for another job (refused), and followers that left unhealthy. The notices live in node 0's store
(``cluster.lobby``)."""

import dataclasses
from typing import TYPE_CHECKING, List, Set

from launcher.cluster.gone import KEY as GONE_KEY
from launcher.cluster.gone import GoneWatch
from launcher.cluster.lobby import (
    ALIVE_PREFIX,
    Lobby,
    StopNotice,
    claimed_counters,
    outside_nodes,
    read_stop,
    read_unhealthy,
    say_ended,
    say_leader,
    say_stop,
)
from launcher.cluster.rendezvous import RoundFailed
from launcher.core.events import Say
from launcher.grammar.errors import PeerStopped, SignalReceived, UsageError
from launcher.process.signals import SignalInbox
from launcher.process.waiting import Wait
from launcher.roles.membership import Membership

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["LobbyHost"]


class LobbyHost:
    def __init__(self, job: Membership, store: "Store", signals: SignalInbox, say: Say) -> None:
        self.job = job
        self._store = store
        self._signals = signals
        self._say = say
        self._lobby = Lobby(store, job.rdzv_id, job.command, job.cluster.node_timeout)
        self.gone = GoneWatch(job.cluster.rdzv_host)  # followers' processes that ended
        store.set(GONE_KEY, self.gone.address)
        say_leader(store, dataclasses.asdict(job.info()))
        self.planned = 0  # attempts this launch has planned
        self._left = 0  # followers that left unhealthy, said so far
        self._left_now: List[int] = []  # of those, the ones the round being met still counts on

    def watch(self) -> None:
        """While the nodes meet: a follower that got a signal stops the job (PeerStopped), and a
        node that came with another command (another rendezvous id) is refused at once. Before
        this launch's first attempt, node 0 stops with it (the job was started wrong); later,
        it goes on waiting for the right node."""
        stop = read_stop(self._store, 0)
        if stop is not None:
            raise PeerStopped(stop.node, stop.signum, stop.said_as)
        self._say_unhealthy_left()
        for hello in self._lobby.strangers():
            reason = self._lobby.refuse(hello, self._signals)
            if not self.planned:
                raise UsageError(reason)
            self._say(f"refused a node: {reason}")

    def watch_round(self) -> None:
        """While the round's nodes announce themselves: a node that left it unhealthy never will,
        so the round fails now instead of at the announcements' deadline (RoundFailed)."""
        self._left_now = []
        self.watch()
        if self._left_now:
            names = ", ".join(map(str, self._left_now))
            raise RoundFailed(f"node(s) {names} left the job unhealthy, and the round counted on them")

    def _say_unhealthy_left(self) -> None:
        """A follower that failed its health check left: said once, with its reason."""
        left = read_unhealthy(self._store)
        self._left_now += [node for node, _ in left[self._left :]]
        for node, why in left[self._left :]:
            self._say(
                f"node {node} left the job: {why}; the job waits for a node in its place "
                f"(the same command on a healthy machine), up to --join-timeout "
                f"{self.job.cluster.join_timeout:g} s"
            )
        self._left = len(left)

    def _gone(self, node: int) -> bool:
        """Whether the supervisor holding ``node``'s claim is gone (its connection ended)."""
        counter = claimed_counters(self._store, [node]).get(node, "")
        return bool(counter) and self.gone.gone(counter[len(ALIVE_PREFIX) :]) is not None

    def outside(self) -> int:
        """Followers that wait outside the running round now (and are not gone)."""
        return len([n for n in outside_nodes(self._store) if not self._gone(n)])

    def tell_outside(self, code: int, reason: str, inside: Set[int]) -> None:
        """The job is over: the nodes that wait outside its round (a late standby, a node back)
        end too, told before this node's store goes away (--node-timeout at most)."""
        try:
            say_ended(self._store, code, reason)
            wait = Wait(self.job.cluster.node_timeout, self._signals)
            self._lobby.await_ended_read(inside, wait, self._gone)
        except (SignalReceived, RuntimeError):  # a second signal; torch's store errors
            pass

    def pass_on_stop(self, error: SignalReceived) -> None:
        """A signal on any node while the nodes meet stops every node, as during an attempt. The
        notice lives in this node's store, which goes away with it: node 0 waits until every
        follower that came has read it (each looks every half second while it meets), within
        --node-timeout (a follower that never looks is dead or frozen); a second signal ends
        the wait."""
        try:
            if not isinstance(error, PeerStopped):
                say_stop(self._store, StopNotice(0, error.signum, error.said_as))
            wait = Wait(self.job.cluster.node_timeout, self._signals)
            self._lobby.await_stop_read(wait, self._say, gone=self._gone)
        except (SignalReceived, RuntimeError):  # a second signal; torch's store errors
            pass
