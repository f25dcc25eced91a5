"""A node's sender: a thread that watches the node's tier and, once every rank of the node holds
a newer whole snapshot, sends that step's slots to the node's peers. It never touches the slots'
writers: a rewrite removes a slot's record before anything else, so a record still in place
(the same inode) after the send means the bytes sent were whole; else the peer discards them."""

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from launcher.core.beats import CopyReading
from launcher.process.memory_tier import HeldSlot, held_slots
from launcher.replicas.wire import (
    Pace,
    WireError,
    connect,
    recv_json,
    send_crc,
    send_json,
    send_view,
)

__all__ = ["Duty", "Sender"]

log = logging.getLogger(__name__)

_LOOK_S = 0.005  # how often the tier folder's mtime is looked at: a copy trails its snapshot by about this
# The records are read when that mtime changed, and at least this often: a record renamed within
# the clock tick of the last change (tmpfs times are coarse, a few ms) leaves the mtime as it was.
_READ_S = 0.02
_TIMEOUT_S = 10.0  # one send's socket calls: a peer that stops answering fails the send
_RETRY_S = 1.0  # after a failed send, before the next try to that peer


@dataclasses.dataclass(frozen=True)
class Duty:
    """What the node copies during one attempt: its ranks (``first``, ``count``) to ``peers``
    (node, address)."""

    attempt: int
    first: int
    count: int
    peers: Tuple[Tuple[int, str], ...]


@dataclasses.dataclass
class _Peer:
    node: int
    address: str
    sent: int = -1  # the newest step it holds, this attempt
    failing: str = ""  # why the sends fail, once said ("" while they succeed)
    failed_once: bool = False  # the last send failed
    retry_at: float = 0.0
    full: bool = False


class Sender:
    """One thread a peer (a peer that stops answering holds up only its own copies), each looking
    at the tier for a newer whole step than its peer holds."""

    def __init__(self, tier: Path, node: int, rate: int, say: Callable[[str], None]) -> None:
        self._tier = tier
        self._node = node
        self._say = say
        self._stopped = threading.Event()
        self._pace = Pace(rate, self._stopped)  # shared: the cap is the node's, over all peers
        self._lock = threading.Lock()
        self._duty: Optional[Duty] = None
        self._peers: List[_Peer] = []
        self._threads: List[threading.Thread] = []
        self._sent = 0  # bytes of whole copies sent

    def assign(self, duty: Optional[Duty]) -> None:
        """The attempt's duty (None: this node runs no rank, it sends nothing). The threads of
        the duty before end at their next look."""
        with self._lock:
            self._duty = duty
            self._peers = [_Peer(node, address) for node, address in (duty.peers if duty else ())]
            peers = list(self._peers)
        if duty is None:
            return
        self._threads = [t for t in self._threads if t.is_alive()]
        for peer in peers:
            thread = threading.Thread(
                target=self._run, args=(duty, peer), name=f"ftlaunch-copy-to-{peer.node}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def lag(self) -> Dict[int, int]:
        """peer node -> the steps its copy trails this node's newest snapshot (-1: none yet)."""
        newest = self._newest()
        with self._lock:
            return {p.node: (newest - p.sent if p.sent >= 0 else -1) for p in self._peers}

    def reading(self) -> Optional[CopyReading]:
        """How far the copies are (None: this node sends none in this attempt). The newest step is
        read from the tier now: a send stuck on a peer does not hide how far behind it is."""
        newest = self._newest()
        with self._lock:
            if not self._peers:
                return None
            return CopyReading(newest, min(p.sent for p in self._peers), self._sent)

    def _newest(self) -> int:
        duty = self._duty
        slots = _newest_whole(self._tier, duty.first, duty.count) if duty is not None else None
        return slots[0].step if slots else -1

    def close(self) -> None:
        """Stop sending; a send in flight is left to its daemon thread (the supervisor's end never
        waits for a peer that stopped answering)."""
        self._stopped.set()
        deadline = time.monotonic() + 1.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self, duty: Duty, peer: _Peer) -> None:
        looked, read_at = -1, 0.0  # the tier folder's mtime when its records were last read, and when
        while not self._stopped.wait(_LOOK_S) and self._duty is duty and not peer.full:
            try:
                changed = os.stat(self._tier).st_mtime_ns  # a record written or removed changes it
            except OSError:
                continue
            now = time.monotonic()
            if (changed == looked and now < read_at + _READ_S) or now < peer.retry_at:
                continue  # nothing new (or a retry not due): no need to read the records
            looked, read_at = changed, now
            slots = _newest_whole(self._tier, duty.first, duty.count)
            if slots is not None and peer.sent < slots[0].step:
                self._send(duty, peer, slots[0].step, slots)

    def _send(self, duty: Duty, peer: _Peer, step: int, slots: List[HeldSlot]) -> None:
        files = _read_whole(self._tier, slots)
        if files is None:
            return  # a snapshot overtook the read: the next look takes the newer step
        try:
            reply = self._put(duty, peer, step, files)
        except (OSError, WireError, ValueError) as err:
            # Said once it fails twice in a row: a peer's end at the job's end breaks one send.
            if peer.failed_once and not peer.failing:
                self._say(
                    f"node {self._node}: copying its memory snapshots to node {peer.node} failed ({err}); "
                    f"training goes on, retried every {_RETRY_S:g} s (node {peer.node} holds "
                    + (f"step {peer.sent} of it)" if peer.sent >= 0 else "none of it)")
                )
            if peer.failed_once:
                peer.failing = str(err) or type(err).__name__
            peer.failed_once, peer.retry_at = True, time.monotonic() + _RETRY_S
            return
        if reply.get("full"):
            peer.full = True
            self._say(
                f"node {self._node}: node {peer.node} has no room left in /dev/shm for copies "
                f"({reply.get('why', '')}): copies to it are off"
            )
        elif reply.get("ok"):
            if peer.failing:
                self._say(f"node {self._node}: copies to node {peer.node} go again, at step {step}")
            with self._lock:
                peer.sent, peer.failing, peer.failed_once = step, "", False
                self._sent += sum(len(data) for _, data in files)

    def _put(
        self, duty: Duty, peer: _Peer, step: int, files: List[Tuple[str, Union[bytes, bytearray]]]
    ) -> dict:
        header = {
            "op": "put",
            "first": duty.first,
            "count": duty.count,
            "attempt": duty.attempt,
            "step": step,
            "source": self._node,
            "files": [{"name": name, "size": len(data)} for name, data in files],
        }
        with connect(peer.address, _TIMEOUT_S) as sock:
            send_json(sock, header)
            go = recv_json(sock)
            if not go.get("ok"):
                return go
            for _, data in files:
                send_crc(sock, send_view(sock, memoryview(data), self._pace))
            send_crc(sock, 1)  # whole: read while the slots held still
            return recv_json(sock)


def _newest_whole(tier: Path, first: int, count: int) -> Optional[List[HeldSlot]]:
    """The slots of the newest step every one of the ranks holds whole, or None."""
    by_rank: Dict[int, Dict[int, HeldSlot]] = {}
    for slot in held_slots(tier):
        if first <= slot.rank < first + count:
            by_rank.setdefault(slot.rank, {})[slot.step] = slot
    if len(by_rank) < count:
        return None
    common = set.intersection(*(set(steps) for steps in by_rank.values()))
    if not common:
        return None
    step = max(common)
    return [by_rank[rank][step] for rank in sorted(by_rank)]


def _read_whole(tier: Path, slots: List[HeldSlot]) -> Optional[List[Tuple[str, Union[bytes, bytearray]]]]:
    """The slots' files as (copy's name, bytes), read in one go (a memcpy's pace, not the
    link's: a slow send never races the writer), or None if a slot changed while it was read."""
    files: List[Tuple[str, Union[bytes, bytearray]]] = []
    try:
        for slot in slots:
            name = f"rank_{slot.rank}"
            files.append((name, _read(slot.path(tier), slot.size)))
            files.append((f"{name}.index", _read(slot.path(tier, ".index"), slot.index_size)))
            files.append((f"{name}.json", slot.record))
    except OSError:
        return None
    return files if all(_unchanged(tier, slot) for slot in slots) else None


def _read(path: Path, size: int) -> bytearray:
    data = bytearray(size)
    with open(path, "rb", buffering=0) as handle:
        got = handle.readinto(data) if size else 0
    if got != size:
        raise OSError(f"{path.name}: {got} of {size} bytes")
    return data


def _unchanged(tier: Path, slot: HeldSlot) -> bool:
    """The slot's record is the one read before: the same file (a rewrite removes it first and
    writes a new one) with the same text (its step: an inode number may be reused at once)."""
    try:
        with open(slot.path(tier, ".json"), "rb") as handle:
            return os.fstat(handle.fileno()).st_ino == slot.record_inode and handle.read() == slot.record
    except OSError:
        return False
