"""The workers' store in a process forked from the fork server, which has imported torch
already: the supervisor then never imports torch on a single node (about 1.2 s of CPU a launch).

The supervisor binds the listening socket (so a taken port is its error, said before any worker
starts) and hands it over with the fork request; connections that come before this process
serves wait in the socket's backlog. It serves until the supervisor kills it, or dies with it
(the parent-death signal every forked worker gets). Not the zygote itself: TCPStore serves on
threads of its own, and the zygote must have none to fork.
"""

import signal
from datetime import timedelta

__all__ = ["serve_store"]


def serve_store(listen_fd: int, addr: str, port: int) -> None:
    from torch.distributed import TCPStore

    _store = TCPStore(  # referenced until the process ends: dropping it stops the server
        addr, port, None, True, timedelta(seconds=60), wait_for_workers=False, master_listen_fd=listen_fd
    )
    while True:  # until the supervisor kills it, or dies (the parent-death signal)
        signal.pause()
