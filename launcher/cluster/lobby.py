"""Before any round, in node 0's store: a follower claims its node rank and says which job it came
for, so that a node started by mistake (a rank a live one holds, another command) is exit 2 at
once, not after --join-timeout; and a signal on any node while they meet stops every node.

    lobby/claim/<n>      the token of the supervisor holding rank n; lobby/alive/<token> its beat
                         counter, also its liveness in attempts
    lobby/hello/<n>      who it is and which job it came for; lobby/hellos lists them ("n,")
    lobby/refused/<n>    node 0's refusal, lobby/read/<n> its ack
    lobby/stopped        which node got which signal; lobby/stop-read/<n> each follower's ack
    lobby/unhealthy      "<n> <why>" lines: followers that failed their health check and left
    lobby/training       the attempt running ("" between attempts): a node that joins meanwhile
                         waits outside its round; lobby/started: node 0 has planned an attempt
    lobby/leader         node 0 as it announces itself: a node that comes once the job started
                         checks itself against it, and leaves alone when it cannot join
    lobby/ended          the job's end (exit code, reason), for the nodes outside its round;
                         lobby/ended-read/<n> each one's ack
    lobby/outside/<n>    "1" while node n waits outside the running round; lobby/outsiders lists
                         the nodes that ever did ("n,")"""

import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from launcher.cluster.alive import AliveCounter, beat_every
from launcher.core.owned import pid_space
from launcher.grammar.errors import UsageError
from launcher.process.waiting import Inbox, Wait

__all__ = [
    "Hello",
    "Lobby",
    "NodeClaim",
    "StopNotice",
    "ALIVE_PREFIX",
    "claimed_counters",
    "read_stop",
    "read_unhealthy",
    "say_stop",
    "read_ended",
    "say_ended",
    "outside_nodes",
    "say_leader",
    "say_outside",
    "say_training",
    "leader_once_started",
    "training",
    "say_unhealthy",
    "stop_read",
]

_STOPPED = "lobby/stopped"
_TRAINING = "lobby/training"
_STARTED = "lobby/started"
_LEADER = "lobby/leader"
_ENDED = "lobby/ended"
_OUTSIDERS = "lobby/outsiders"
ALIVE_PREFIX = "lobby/alive/"  # + a claim's token: its supervisor's beat counter

# How many of a claimant's beats its counter is watched for before it is judged gone.
_JUDGE_BEATS = 3


@dataclasses.dataclass(frozen=True)
class Hello:
    node: int
    host: str
    pid: int
    rdzv_id: str
    command: List[str]


@dataclasses.dataclass(frozen=True)
class StopNotice:
    """A node that got a signal while the nodes met: every node stops as it does."""

    node: int
    signum: int
    said_as: str  # the signal's name as the user sent it (SIGUSR1 for a preemption notice)


def say_stop(store, notice: StopNotice) -> None:
    """Tell every node (through node 0's store) that ``notice.node`` stops; the first notice
    stands: two nodes signalled at once stop the job once."""
    store.compare_set(_STOPPED, "", json.dumps(dataclasses.asdict(notice)))
    stop_read(store, notice.node)


def read_stop(store, node: int) -> Optional[StopNotice]:
    """Another node's stop, if one came."""
    if not store.check([_STOPPED]):
        return None
    notice = StopNotice(**json.loads(_text(store.get(_STOPPED))))
    return notice if notice.node != node else None


def say_training(store, attempt: Optional[int]) -> None:
    """Node 0: an attempt runs (its number), or none (None)."""
    store.set(_TRAINING, "" if attempt is None else str(attempt))
    if attempt is not None:
        store.set(_STARTED, "1")


def say_ended(store, code: int, reason: str) -> None:
    """Node 0: the job is over; the nodes waiting outside its round end too."""
    store.set(_ENDED, json.dumps({"code": code, "reason": reason}))


def read_ended(store, node: int) -> Optional[Tuple[int, str]]:
    """The job's end (exit code, reason), acked, once node 0 said it."""
    if not store.check([_ENDED]):
        return None
    said = json.loads(_text(store.get(_ENDED)))
    store.set(f"lobby/ended-read/{node}", "1")
    return int(said["code"]), str(said["reason"])


def say_outside(store, node: int, outside: bool) -> None:
    """A follower waits outside the running round (True), or no longer (False)."""
    if outside:
        store.append(_OUTSIDERS, f"{node},")
    store.set(f"lobby/outside/{node}", "1" if outside else "")


def outside_nodes(store) -> List[int]:
    """Node 0: the followers waiting outside the running round now."""
    if not store.check([_OUTSIDERS]):
        return []
    nodes = sorted({int(n) for n in _text(store.get(_OUTSIDERS)).split(",") if n})
    flags = store.multi_get([f"lobby/outside/{n}" for n in nodes])
    return [n for n, flag in zip(nodes, flags) if _text(flag) == "1"]


def say_leader(store, info: dict) -> None:
    """Node 0, once: itself, as the nodes of a round announce themselves."""
    store.set(_LEADER, json.dumps(info))


def leader_once_started(store) -> Optional[dict]:
    """Node 0's announcement, once it has planned an attempt (None before, or an older node 0)."""
    if not store.check([_STARTED]) or not store.check([_LEADER]):
        return None
    return json.loads(_text(store.get(_LEADER)))


def training(store) -> bool:
    """Whether an attempt runs: a node that joins the rendezvous now waits outside its round."""
    return bool(store.check([_TRAINING])) and bool(_text(store.get(_TRAINING)))


def stop_read(store, node: int) -> None:
    """A follower has the notice (node 0 waits for this before its store goes away)."""
    if node != 0:
        store.set(f"lobby/stop-read/{node}", "1")


_UNHEALTHY = "lobby/unhealthy"


def say_unhealthy(store, node: int, why: str) -> None:
    """A follower leaves the job unhealthy: node 0 says why, instead of only missing it."""
    store.append(_UNHEALTHY, f"{node} {' '.join(why.split())}\n")


def read_unhealthy(store) -> List[Tuple[int, str]]:
    """Every follower that left unhealthy so far, in order: (node, why)."""
    if not store.check([_UNHEALTHY]):
        return []
    lines = [line.split(" ", 1) for line in _text(store.get(_UNHEALTHY)).splitlines() if " " in line]
    return [(int(node), why) for node, why in lines]


class NodeClaim:
    """A follower's hold on its node rank, for as long as its supervisor lives (one token per
    process: a reconnect to the same node 0 finds its own claim)."""

    def __init__(self, node: int, hello: Hello, node_timeout: float) -> None:
        """``node_timeout``: the job's --node-timeout, which sets how often its counter beats
        (every node of a job has the same: one command)."""
        self.node = node
        self._every = beat_every(node_timeout)
        self.token = f"{pid_space()}:{os.getpid()}:{time.monotonic_ns()}"
        self._hello = hello
        self._beat: Optional[AliveCounter] = None

    def take(self, store, beat_store, signals: Inbox) -> None:
        """Hold node rank ``node`` (UsageError: a live supervisor holds it) and say hello.
        ``beat_store``: the same store for the liveness thread, whose calls may block."""
        self.release()
        store.add(f"lobby/alive/{self.token}", 0)  # there before node 0 reads it (a multi_get waits)
        self._beat = AliveCounter(beat_store, f"lobby/alive/{self.token}", self._every)
        self._beat.start()
        key = f"lobby/claim/{self.node}"
        holder = _text(store.compare_set(key, "", self.token))
        if holder != self.token:
            if _alive(store, holder, signals, self._every):
                host, pid = holder.split(":")[:2]
                raise UsageError(
                    f"node rank {self.node} is already held by the supervisor on {host} (pid {pid}), "
                    "which is alive: each node needs its own --node-rank"
                )
            store.compare_set(key, holder, self.token)
            if _text(store.get(key)) != self.token:
                raise UsageError(f"node rank {self.node} was taken by another supervisor at the same moment")
        store.set(f"lobby/hello/{self.node}", json.dumps(dataclasses.asdict(self._hello)))
        store.append("lobby/hellos", f"{self.node},")

    def refusal(self, store) -> str:
        """Node 0's refusal of this node, if any (read: node 0 may then go)."""
        key = f"lobby/refused/{self.node}"
        if not store.check([key]):
            return ""
        store.set(f"lobby/read/{self.node}", "1")
        return _text(store.get(key))

    @property
    def beater(self) -> Optional[AliveCounter]:
        """The thread beating this claim's counter, also the node's liveness in attempts."""
        return self._beat

    def release(self, patient: bool = True) -> None:
        """``patient``: wait for the beat to end (not patient: node 0 does not answer, it would not)."""
        if self._beat is not None:
            self._beat.stop()
            if patient:
                self._beat.join(2 * self._every)  # not left inside a store call at exit, unless stuck there
            self._beat = None


class Lobby:
    """Node 0's side: it reads the followers' hellos while it waits for a round."""

    def __init__(self, store, rdzv_id: str, command, node_timeout: float) -> None:
        self._store = store
        self._rdzv_id = rdzv_id
        self._command = list(command)
        self._node_timeout = node_timeout
        self._refused: set = set()

    def strangers(self) -> List[Hello]:
        """Followers that came for another job (another rendezvous id), not refused yet."""
        if not self._store.check(["lobby/hellos"]):
            return []
        said = sorted(
            {int(n) for n in _text(self._store.get("lobby/hellos")).split(",") if n} - self._refused
        )
        texts = self._store.multi_get([f"lobby/hello/{n}" for n in said]) if said else []
        hellos = [Hello(**json.loads(_text(text))) for text in texts]
        return [hello for hello in hellos if hello.rdzv_id != self._rdzv_id]

    def await_stop_read(
        self, wait: Wait, say: Callable[[str], None], gone: Callable[[int], bool] = lambda _: False
    ) -> None:
        """Node 0 stops while the nodes meet: wait (``wait``'s limit at most) until every follower
        read the notice, which goes away with this node's store; one whose supervisor is
        ``gone`` never will."""
        said = self._store.get("lobby/hellos") if self._store.check(["lobby/hellos"]) else b""
        nodes, told = {int(n) for n in _text(said).split(",") if n}, False
        while not wait.expired:
            nodes = {n for n in nodes if not self._store.check([f"lobby/stop-read/{n}"]) and not gone(n)}
            if not nodes:
                return
            if not told and wait.waited >= 1.0:
                told = True
                names = ", ".join(map(str, sorted(nodes)))
                say(
                    f"stopping every node: waiting up to {wait.left:.0f} s for node(s) {names} to "
                    "learn of it (a second signal ends the wait)"
                )
            wait.pause()

    def await_ended_read(self, inside: Set[int], wait: Wait, gone: Callable[[int], bool]) -> None:
        """The job is over: wait (``wait``'s limit) until every follower that came but is not
        ``inside`` the last round has read the end (``say_ended``), or is gone."""
        said = self._store.get("lobby/hellos") if self._store.check(["lobby/hellos"]) else b""
        nodes = {int(n) for n in _text(said).split(",") if n} - inside - self._refused
        while nodes and not wait.expired:
            nodes = {n for n in nodes if not self._store.check([f"lobby/ended-read/{n}"]) and not gone(n)}
            wait.pause()

    def refuse(self, hello: Hello, signals: Inbox) -> str:
        """Tell ``hello``'s node why it cannot join; wait (--node-timeout at most, a signal ends
        it) until it read it."""
        reason = (
            f"node {hello.node} ({hello.host}) runs another command than node 0: "
            f"{' '.join(hello.command[1:])}; node 0 runs {' '.join(self._command[1:])}"
        )
        self._refused.add(hello.node)
        self._store.set(f"lobby/refused/{hello.node}", reason)
        wait = Wait(self._node_timeout, signals)
        while not wait.expired and not self._store.check([f"lobby/read/{hello.node}"]):
            wait.pause()
        return reason


def claimed_counters(store, nodes: List[int]) -> Dict[int, str]:
    """Node 0's side: the counter each of ``nodes``' claims beats (``lobby/alive/<token>``), read
    in one call; a node without a claim is left out."""
    keys = [f"lobby/claim/{n}" for n in nodes]
    held = [n for n, ok in zip(nodes, [store.check([key]) for key in keys]) if ok]
    tokens = store.multi_get([f"lobby/claim/{n}" for n in held]) if held else []
    return {n: f"{ALIVE_PREFIX}{_text(token)}" for n, token in zip(held, tokens)}


def _alive(
    store, token: str, signals: Inbox, every: float, clock: Callable[[], float] = time.monotonic
) -> bool:
    """Whether the supervisor holding ``token`` still beats: on this host's PID namespace the
    kernel says at once; elsewhere three of its beats are watched for."""
    host, pid = token.split(":")[:2]
    if host == pid_space() and not _pid_alive(int(pid)):
        return False
    key = f"lobby/alive/{token}"
    before = store.add(key, 0)
    wait = Wait(_JUDGE_BEATS * every, signals, look=0.1, clock=clock)
    while not wait.expired:
        wait.pause()
        if store.add(key, 0) != before:
            return True
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
