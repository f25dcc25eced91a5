"""The copies' wire: one TCP connection per request. A message is a header (its length, then
JSON) and raw bytes after it; each file's CRC32 goes after its bytes, computed on the bytes as
sent, so a copy torn on the way (or rewritten under the sender) is never taken for whole."""

import json
import socket
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import BinaryIO, Optional

__all__ = [
    "Pace",
    "WireError",
    "connect",
    "recv_crc",
    "recv_file",
    "recv_json",
    "send_crc",
    "send_file",
    "send_json",
    "send_view",
]

_LENGTH = struct.Struct("!I")
_MAX_HEADER = 1 << 20
CHUNK = 1 << 20


class WireError(Exception):
    """The other end closed, answered garbage or sent bytes that do not match their checksum."""


def connect(address: str, timeout: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def send_json(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_json(sock: socket.socket) -> dict:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > _MAX_HEADER:
        raise WireError(f"a header of {length} bytes")
    try:
        message = json.loads(_recv_exact(sock, length))
    except ValueError as err:
        raise WireError(f"a header that is not JSON: {err}") from None
    if not isinstance(message, dict):
        raise WireError("a header that is not an object")
    return message


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), CHUNK))
        if not chunk:
            raise WireError(f"the other end closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


class Pace:
    """At most ``rate`` bytes a second over every send it paces (0: no cap): a copy waits for its
    turn instead of taking the network from the job's own traffic."""

    def __init__(self, rate: int, stopped: Optional[threading.Event] = None) -> None:
        self._rate = rate
        self._free_at = time.monotonic()
        self._stopped = stopped or threading.Event()

    def take(self, size: int) -> None:
        if self._rate <= 0:
            return
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + size / self._rate
        if start > now:
            self._stopped.wait(start - now)


def send_view(sock: socket.socket, view: memoryview, pace: Pace) -> int:
    """Send ``view``'s bytes; their CRC32."""
    crc = 0
    for at in range(0, len(view), CHUNK):
        chunk = view[at : at + CHUNK]
        pace.take(len(chunk))
        crc = zlib.crc32(chunk, crc)
        sock.sendall(chunk)
    return crc


def send_file(sock: socket.socket, path: Path, size: int, pace: Pace) -> int:
    """Send ``size`` bytes of ``path`` (read, never mapped: a file cut short under a mapping would
    be a SIGBUS in this process); their CRC32. A file shorter than ``size``: WireError."""
    crc, left = 0, size
    buffer = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while left:
            got = handle.readinto(view[: min(left, len(buffer))])
            if not got:
                raise WireError(f"{path.name} ended after {size - left} of {size} bytes")
            pace.take(got)
            crc = zlib.crc32(view[:got], crc)
            sock.sendall(view[:got])
            left -= got
    return crc


def send_crc(sock: socket.socket, crc: int) -> None:
    sock.sendall(_LENGTH.pack(crc))


def recv_crc(sock: socket.socket) -> int:
    return int(_LENGTH.unpack(_recv_exact(sock, _LENGTH.size))[0])


def recv_file(sock: socket.socket, out: BinaryIO, size: int) -> int:
    """Receive ``size`` bytes into ``out``; their CRC32."""
    crc, left = 0, size
    buffer = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buffer)
    while left:
        got = sock.recv_into(view[: min(left, len(buffer))])
        if not got:
            raise WireError(f"the other end closed after {size - left} of {size} bytes")
        crc = zlib.crc32(view[:got], crc)
        out.write(view[:got])
        left -= got
    return crc
