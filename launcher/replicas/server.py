"""Each node's copy server: a thread on a TCP port of the node's own address that takes other
nodes' copies (``put``) into what it holds, and says (``newest``) and sends (``get``) what it
holds to a node that restores. One request a connection, each on a thread of its own."""

import logging
import os
import socket
import threading
from typing import Callable, List, Tuple

from launcher.process.memory_tier import snapshot_room_needed
from launcher.replicas.held import Copy, HeldCopies, NoRoomForCopy
from launcher.replicas.wire import Pace, WireError, recv_json, send_crc, send_file, send_json

__all__ = ["CopyServer"]

log = logging.getLogger(__name__)

_AT_ONCE = 16  # requests served at once; more are closed at once (the sender retries)
_TIMEOUT_S = 30.0  # one request's socket reads and writes: a peer that stops answering is dropped


class CopyServer:
    def __init__(self, address: Tuple[str, str], held: HeldCopies, on_full: Callable[[str], None]) -> None:
        """``address``: (the host to bind, "" for every interface; the host others reach it at)."""
        bind, reached_at = address
        self.held = held
        self._on_full = on_full
        self._sock = _listen(bind)
        self._sock.settimeout(0.5)
        port = self._sock.getsockname()[1]
        self.address = f"[{reached_at}]:{port}" if ":" in reached_at else f"{reached_at}:{port}"
        self._closed = threading.Event()
        self._full = False
        self._slots = threading.BoundedSemaphore(_AT_ONCE)
        self._thread = threading.Thread(target=self._serve, name="ftlaunch-copy-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux), no half-second wait
        except OSError:
            pass
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # a peer that opens connections without end
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn,), name="ftlaunch-copy", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            self._answer_one(conn)
        finally:
            self._slots.release()

    def _answer_one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_TIMEOUT_S)
            try:
                request = recv_json(conn)
                op = request.get("op")
                if op == "put":
                    self._put(conn, request)
                elif op == "newest":
                    send_json(conn, {"copies": [_said(c) for c in self._copies(request)]})
                elif op == "get":
                    self._get(conn, request)
                else:
                    send_json(conn, {"ok": False, "why": f"no such request: {op!r}"})
            except (OSError, WireError, ValueError, KeyError, TypeError) as err:
                log.debug("a copy request failed: %s", err)

    def _put(self, conn: socket.socket, request: dict) -> None:
        if self._full:
            send_json(conn, {"ok": False, "full": True, "why": "it filled up before"})
            return
        short = self._short_of_room(sum(int(f["size"]) for f in request["files"]))
        if short:
            self._full = True
            self._on_full(short)
            send_json(conn, {"ok": False, "full": True, "why": short})
            return
        send_json(conn, {"ok": True})  # go ahead
        try:
            reply = self.held.receive(conn, request)
        except NoRoomForCopy as err:
            self._full = True
            self._on_full(str(err))
            reply = {"ok": False, "full": True, "why": str(err)}
        send_json(conn, reply)

    def _short_of_room(self, size: int) -> str:
        """Why a copy of ``size`` bytes must not come ('' if it may): the node's own snapshots
        come first. Before its ranks made any, they are taken to need what the copy's ranks do
        (two snapshots each, as a copy holds one)."""
        tier = self.held.folder.parent
        stat = os.statvfs(tier)
        free = stat.f_bavail * stat.f_frsize
        own = snapshot_room_needed(tier)
        own = 2 * size if own is None else own
        if free >= size + own:
            return ""
        return (
            f"{_size(free)} free in {tier.parent}; a copy of {_size(size)} and this node's own "
            f"snapshots ({_size(own)} more) need more"
        )

    def _copies(self, request: dict) -> List[Copy]:
        copies = self.held.copies(int(request["first"]), int(request["count"]))
        return [c for c in copies if c.attempt <= int(request["attempt"])]

    def _get(self, conn: socket.socket, request: dict) -> None:
        copies = [
            c for c in self._copies(request) if (c.attempt, c.step) == (request["attempt"], request["step"])
        ]
        if not copies:
            send_json(conn, {"found": False})
            return
        copy = copies[0]
        names = sorted(copy.files)
        send_json(conn, {"found": True, **_said(copy), "files": [[n, copy.files[n][0]] for n in names]})
        pace = Pace(0)
        for name in names:
            send_crc(conn, send_file(conn, copy.folder / name, copy.files[name][0], pace))


def _listen(bind: str) -> socket.socket:
    """A listening socket on ``bind`` ("": every interface, IPv6 and IPv4 where both are there)."""
    if not bind and socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server((bind, 0), family=socket.AF_INET6 if ":" in bind else socket.AF_INET)


def _size(count: int) -> str:
    return f"{count / 2**20:.0f} MiB" if count >= 2**20 else f"{count / 2**10:.0f} KiB"


def _said(copy: Copy) -> dict:
    return {"attempt": copy.attempt, "step": copy.step, "source": copy.source, "size": copy.size}
