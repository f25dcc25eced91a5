"""The per-attempt TCPStore the supervisor hosts for its workers (single node): served by the
supervisor itself, or by a process forked from the fork server (``launcher.forked.store_host``),
which spares the supervisor importing torch.

A fresh store per attempt, bound by the supervisor before any worker starts, so there is no
port race across restarts: the port is held from bind to the end of the attempt and handed to
the workers as MASTER_PORT. Workers connect as clients (TORCHELASTIC_USE_AGENT_STORE=True), as
under torchrun, and nothing of a failed attempt's rendezvous can leak into the next one.
"""

import socket
from datetime import timedelta
from typing import Callable, Optional, Protocol

from launcher.process.quiet_torch import import_torch

__all__ = ["AttemptStore", "HostedStore", "NotServed", "StoreHost", "host_here", "listen", "unless_stopping"]


class HostedStore(Protocol):
    """A store served by another process of ours (one forked from the fork server)."""

    def stop(self) -> None: ...


# Given the bound listening socket, serve the store elsewhere (and return its handle), or None:
# this process serves it.
StoreHost = Callable[[socket.socket], Optional[HostedStore]]


def host_here(listener: socket.socket) -> Optional[HostedStore]:
    return None


class NotServed:
    """An attempt's store that nobody serves: a signal came before the attempt could start, so
    none of its workers will connect. Serving it here would first import torch: seconds before
    the signal is answered."""

    def stop(self) -> None:
        pass


def unless_stopping(host: StoreHost, stopping: Callable[[], bool]) -> StoreHost:
    """``host``, except that a store it leaves to this process is not served once ``stopping()``."""

    def hosted(listener: socket.socket) -> Optional[HostedStore]:
        served = host(listener)
        return NotServed() if served is None and stopping() else served

    return hosted


class AttemptStore:
    def __init__(self, addr: str, port: int = 0, host: StoreHost = host_here) -> None:
        listener = listen(addr, port)
        self.port = listener.getsockname()[1]
        self._store = None
        try:
            self._hosted = host(listener)
        except BaseException:
            listener.close()
            raise
        if self._hosted is not None:
            listener.close()  # the host has its own copy
            return
        import_torch()
        from torch.distributed import TCPStore  # the supervisor's only use of torch on one node

        # The store takes ownership of the listening socket we bound, so it serves on exactly
        # ``addr`` (loopback by default), not on every interface.
        self._store = TCPStore(
            addr,
            self.port,
            None,
            True,
            timedelta(seconds=60),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def close(self) -> None:
        if self._hosted is not None:
            self._hosted.stop()
            self._hosted = None
        self._store = None  # dropping the last reference stops the server and frees the port


def listen(addr: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port, reused at once
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock
