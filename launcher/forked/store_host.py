"""The workers' stores in a process forked from the fork server, which has imported torch
already: the supervisor then never imports torch on a single node (about 1.2 s of CPU a launch).

One store host serves the run's attempts one after the other: the supervisor binds each
attempt's listening socket (so a taken port is its error, said before any worker starts) and
hands it over; a restart then waits for a message, not for a fork, and the last attempt's store
is closed by a message, not by killing a process the kernel needs ~20 ms to unmap. Connections
that come before a store serves wait in the socket's backlog. Not the zygote itself: TCPStore
serves on threads of its own, and the zygote must have none to fork.

Messages on its socket (SOCK_SEQPACKET, one JSON object each, each answered):
- ``{"serve": [addr, port]}`` with the listening socket: the last store is closed, a new one
  serves on it; answered ``{"serving": port}`` or ``{"error": "..."}``.
- ``{"close": true}``: the last store is closed (its port free once answered ``{"closed": true}``).
EOF on the socket (the supervisor let it go, or died) ends it, as does the parent-death signal.
"""

import json
import os
import socket
from datetime import timedelta
from typing import Dict, List

__all__ = ["serve_stores"]


def serve_stores(sock_fd: int) -> None:
    sock = socket.socket(fileno=sock_fd)
    serving: List[object] = []  # the store serving now, at most one: dropping it stops its server
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)
        request = json.loads(data)
        serving.clear()  # the last store's server stops and its port is free
        answer: Dict[str, object] = {"closed": True}
        if "serve" in request:
            addr, port = request["serve"]
            try:
                serving.append(_serve(addr, port, fds[0]))
                answer = {"serving": port}
            except Exception as err:  # noqa: BLE001 - said to the supervisor, which serves it itself
                os.close(fds[0])
                answer = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
        try:
            sock.send(json.dumps(answer).encode())
        except OSError:
            os._exit(0)


def _serve(addr: str, port: int, listen_fd: int):
    from torch.distributed import TCPStore

    return TCPStore(
        addr, port, None, True, timedelta(seconds=60), wait_for_workers=False, master_listen_fd=listen_fd
    )
