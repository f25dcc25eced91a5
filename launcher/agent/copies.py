"""This node's part in copying memory snapshots to other nodes (--memory-peers, issue 51): its
copy server and sender for the supervisor's life, and at each attempt's start the restore of its
ranks' snapshots from another node's copy where its own tier holds none. ``NO_COPIES`` where
there is nothing to copy: one node, no /dev/shm, or --memory-peers 0."""

import ipaddress
import logging
import socket
from pathlib import Path
from typing import Callable, Optional, Tuple

from launcher.core.beats import CopyReading
from launcher.core.config import CopySection
from launcher.core.events import CopiesNoted, CopyRestored, EventLog
from launcher.replicas.held import HeldCopies
from launcher.replicas.peers import peers_of
from launcher.replicas.restore import needs_restore, restore
from launcher.replicas.sender import Duty, Sender
from launcher.replicas.server import CopyServer
from launcher.roles.role import AttemptPlan

__all__ = ["NO_COPIES", "NodeCopies", "NoCopies", "copy_address"]

log = logging.getLogger(__name__)
_MIB = 2**20


class NoCopies:
    address = ""

    def begin(self, plan: AttemptPlan, go_on: Callable[[], bool] = lambda: True) -> str:
        return ""

    def note(self, attempt: int) -> Optional[CopyReading]:
        """How far this node's copies are (None: it makes none), noted in the event log when
        that changed."""
        return None

    def close(self) -> None:
        pass


NO_COPIES = NoCopies()


class NodeCopies(NoCopies):
    def __init__(
        self,
        tier: Path,
        node: int,
        section: CopySection,
        address: Tuple[str, str],
        events: EventLog,
        say: Callable[[str], None],
    ) -> None:
        self._tier, self._node, self._section = tier, node, section
        self._events, self._say = events, say
        self._full_said = False
        self._noted: Optional[CopyReading] = None
        self._server = CopyServer(address, HeldCopies(tier / "peers"), self._on_full)
        self.address = self._server.address
        self._sender = Sender(tier, node, section.rate, say)

    def begin(self, plan: AttemptPlan, go_on: Callable[[], bool] = lambda: True) -> str:
        """Before the attempt's workers start: restore where needed (``go_on``: asked between
        holders; a signal ends the restore), then send to this attempt's peers (a standby sends
        nothing; it still keeps what it holds). What was restored, for node 0's summary ('')."""
        layout = plan.layout
        if not layout.trains:
            self._sender.assign(None)
            return ""
        first, count = layout.rank(0), layout.nproc
        hosts = {node: host for node, host, _ in plan.copies}
        addresses = {node: address for node, _, address in plan.copies}
        # A position's copies go to the nodes after it (peers_of): those are whom to ask, never
        # every node (a restart of a job without snapshots asks R nodes, not hundreds).
        peers = [
            (n, addresses[n])
            for n in peers_of(self._node, layout.nodes, hosts, self._section.peers)
            if n in addresses
        ]
        restored = ""
        if plan.attempt > 0 and peers and needs_restore(self._tier, first, count):
            restored = self._restore(plan.attempt, first, count, peers, go_on)
        self._sender.assign(Duty(plan.attempt, first, count, tuple(peers)))
        return restored

    def _restore(self, attempt: int, first: int, count: int, holders: list, go_on: Callable[[], bool]) -> str:
        ranks = list(range(first, first + count))
        named = f"rank{'s' if count > 1 else ''} {first}" + (f"-{first + count - 1}" if count > 1 else "")
        restored, problems = restore(self._tier, first, count, attempt - 1, holders, go_on)
        for problem in problems:
            log.info("node %d: a copy could not be fetched: %s", self._node, problem)
        if restored is None:
            whose = f"{named}'s memory snapshots"
            self._say(
                f"node {self._node}: no copy of {whose} could be fetched ({'; '.join(problems)}): they load "
                "from storage"
                if problems
                else f"node {self._node}: no other node holds a copy of {whose}: they load from storage"
            )
            return ""
        self._events.emit(
            CopyRestored(
                attempt,
                restored.step,
                ranks,
                restored.holder,
                restored.source,
                restored.size,
                round(restored.seconds, 3),
            )
        )
        got = f"step {restored.step} of {named} from node {restored.holder}'s copy of node {restored.source}"
        self._say(f"node {self._node}: {got} ({restored.size / _MIB:.1f} MiB in {restored.seconds:.2f} s)")
        return f"node {self._node} got {got}"

    def note(self, attempt: int) -> Optional[CopyReading]:
        reading = self._sender.reading()
        if reading is not None and reading != self._noted:
            self._noted = reading
            self._events.emit(CopiesNoted(attempt, reading.newest, reading.copied, reading.sent))
        return reading

    def _on_full(self, why: str) -> None:
        if not self._full_said:
            self._full_said = True
            self._say(
                f"node {self._node}: /dev/shm has no room for other nodes' copies ({why}): it takes no more"
            )

    def close(self) -> None:
        self._sender.close()
        self._server.close()


def copy_address(rdzv_endpoint: str, leads: bool) -> Tuple[str, str]:
    """(the address this node's copy server binds, the one other nodes reach it at). Node 0: the
    endpoint's host is how the others reach it (its own lookup of its name may say 127.0.1.1, as
    Debian's /etc/hosts does), so it binds every interface, or the loopback one when the job is on
    loopback. Another node: the address its host uses towards node 0 (a UDP socket's connect picks
    the route; no packet is sent)."""
    host = rdzv_endpoint.rpartition(":")[0].strip("[]")
    if leads:
        return (host if _loopback(host) else "", host)
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            route = str(probe.getsockname()[0])
    except OSError:
        route = socket.gethostname()
    return route, route


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False
