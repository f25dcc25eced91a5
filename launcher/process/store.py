"""The per-attempt TCPStore the supervisor hosts for its workers (single node).

A fresh store per attempt, bound by the supervisor before any worker starts, so there is no
port race across restarts: the port is held from bind to the end of the attempt and handed to
the workers as MASTER_PORT. Workers connect as clients (TORCHELASTIC_USE_AGENT_STORE=True), as
under torchrun, and nothing of a failed attempt's rendezvous can leak into the next one.
"""

import socket
from datetime import timedelta

__all__ = ["AttemptStore", "listen"]


class AttemptStore:
    def __init__(self, addr: str, port: int = 0) -> None:
        from torch.distributed import TCPStore  # the supervisor's only use of torch

        listener = listen(addr, port)
        self.port = listener.getsockname()[1]
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
