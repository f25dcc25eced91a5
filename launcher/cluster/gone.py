"""A follower's supervisor gone from a machine that stays up, seen at once. TCPStore reports no
disconnects, so each follower holds one TCP connection of its own to node 0 for its life, and says
nothing on it but its claim's token: when the process ends (kill -9, the OOM killer, a crash) the
kernel closes it, and node 0 reads the end within a look. A frozen process keeps it open and a
machine gone may never close it: those stay --node-timeout's to find.

    lobby/gone-watch   HOST:PORT where node 0 listens (absent: an older node 0; nothing is held)"""

import selectors
import socket
import threading
import time
from typing import Dict, Optional

__all__ = ["GoneWatch", "hold_open"]

KEY = "lobby/gone-watch"
_TOKEN_BYTES = 256  # a claim's token is "<pid space>:<pid>:<ns>"
_CONNECT_S = 2.0


class GoneWatch:
    """Node 0's end: a listener on ``host`` and a thread that notes when each token's connection
    ends (``gone``)."""

    def __init__(self, host: str) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        host_, port = self._listener.getsockname()[:2]
        self.address = f"[{host_}]:{port}" if ":" in host_ else f"{host_}:{port}"
        self._ended: Dict[str, float] = {}  # token → when its connection ended (monotonic)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ftlaunch-gone-watch", daemon=True)
        self._thread.start()

    def gone(self, token: str) -> Optional[float]:
        """When the connection of the supervisor holding ``token`` ended (None: open, or never made)."""
        return self._ended.get(token)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, bytearray())

    def _read(self, conn: socket.socket, said: bytearray) -> None:
        try:
            data = conn.recv(_TOKEN_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data and len(said) + len(data) <= _TOKEN_BYTES:
            said += data
            if said.endswith(b"\n"):  # a supervisor that holds it anew (after losing node 0)
                self._ended.pop(_token(said), None)
            return
        self._selector.unregister(conn)
        conn.close()
        if data == b"" and said.endswith(b"\n"):  # the end of the connection: its process is gone
            self._ended[_token(said)] = time.monotonic()


def _token(said: bytearray) -> str:
    return bytes(said).rstrip(b"\n").decode(errors="replace")


def hold_open(address: str, token: str) -> Optional[socket.socket]:
    """A follower's end: the connection, kept by the caller for the process's life (None: node 0
    could not be reached; its --node-timeout still finds this node gone)."""
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_S)
        conn.sendall(token.encode() + b"\n")
    except (OSError, ValueError):
        return None
    return conn
