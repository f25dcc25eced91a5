"""Where nodes meet. Node 0 hosts the job's TCPStore at --rdzv-endpoint; every node joins one
round of torch.distributed.elastic's dynamic rendezvous (the c10d backend torchrun uses) per
attempt, through its public API only: ``C10dRendezvousBackend``, ``create_handler``,
``next_rendezvous``, ``set_closed``, ``shutdown``. Each round hands out a store under the round's
own prefix: what nodes say about one attempt can never leak into the next."""

import os
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from launcher.core.config import ClusterSection
from launcher.grammar.errors import JobOver, JoinTimeout, UsageError
from launcher.process.attempt_store import listen
from launcher.process.quiet_torch import import_torch
from launcher.process.signals import SignalInbox
from launcher.process.waiting import Wait

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["LeaderUnreachable", "Rendezvous", "Round", "RoundFailed", "connect_job_store", "host_job_store"]

_CONNECT_TRY_S = 2.0  # one connection try; between tries, signals are looked at
_ROUND_SLACK_S = 30.0
_SAY_EVERY_S = 30.0  # while waiting: one line this often
WATCH_EVERY_S = 0.5  # while the nodes meet: how often the caller's watch looks
# Rendezvous handlers a follower dropped when it lost node 0 (see Rendezvous.drop): a few per run.
_DROPPED: list = []
# --nnodes MIN:MAX: how long a round with MIN nodes waits for more (torch's 30 s is too long for a
# shrink's restart); --rdzv-conf last_call_timeout=N overrides it.
LAST_CALL_S = 5
# With --standby-nodes a round that has every training position filled waits this long for more:
# a standby that is late joins the next round (it stands by outside this one meanwhile), and a
# lost node's replacement is not held up by the nodes that will never come.
STANDBY_LAST_CALL_S = 1


class LeaderUnreachable(Exception):
    """The job's store (node 0's supervisor) cannot be reached: it died, or its machine did."""


class RoundFailed(Exception):
    """A node of the round never announced itself (died on the way): every node meets again."""


def host_job_store(cluster: ClusterSection):
    """Node 0: the store every node meets on, bound to exactly the endpoint's address."""
    import_torch()
    from torch.distributed import TCPStore

    try:
        listener = listen(cluster.rdzv_host, cluster.rdzv_port)
    except OSError as err:
        raise UsageError(
            f"node 0 cannot listen on --rdzv-endpoint {cluster.rdzv_endpoint}: {err.strerror or err} "
            "(the endpoint must be this node's address and a free port)"
        ) from None
    return TCPStore(
        cluster.rdzv_host,
        cluster.rdzv_port,
        None,
        True,
        timedelta(seconds=cluster.node_timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def connect_job_store(
    cluster: ClusterSection,
    deadline: float,
    signals: SignalInbox,
    say: Callable,
    ended: Callable[[], str] = str,
):
    """The other nodes: connect to node 0's store, trying until ``deadline`` (monotonic), since
    node 0 may start later. The port is probed plainly first: torch's client prints a C++ stack
    for every refused try. ``ended()`` says (every 5 s) why the job is over for good, or ''."""
    wait = Wait(deadline - time.monotonic(), signals, since=0, look=0.2)
    connecting: Optional[_Connecting] = None
    listened = False  # node 0's port took a connection at least once
    while True:
        wait.check_signals()
        if connecting is None and _listening(
            cluster.rdzv_host, cluster.rdzv_port, min(_CONNECT_TRY_S, max(wait.left, 0.1))
        ):
            listened = True
            connecting = _Connecting(
                cluster.rdzv_host, cluster.rdzv_port, min(_CONNECT_TRY_S, max(wait.left, 1.0))
            )
        if connecting is not None:
            store = connecting.result(wait)
            if store is not None:
                store.set_timeout(timedelta(seconds=cluster.node_timeout))
                return store
            if not connecting.stuck:
                connecting = None  # refused or broken: the next look tries anew
        if wait.expired:
            heard = " (it accepts connections but did not answer as a store)" if listened else ""
            raise JoinTimeout(
                f"node 0 did not answer at {cluster.rdzv_endpoint}{heard} within --join-timeout "
                f"({cluster.join_timeout:g} s); relaunching the same command resumes the job"
            )
        if wait.due(_SAY_EVERY_S / 6, "look", first=0):  # node 0 gone for good: the job may be over
            why = ended()
            if why:
                raise JobOver(why)
        if wait.due(_SAY_EVERY_S, first=0):
            waited = cluster.join_timeout - wait.left
            limit = f"--join-timeout {cluster.join_timeout:g} s"
            mute = (
                " (it accepts connections but does not answer as a store)"
                if connecting and connecting.stuck
                else ""
            )
            say(f"waiting for node 0 at {cluster.rdzv_endpoint}{mute} ({waited:.0f} s of {limit})")
        wait.pause()


class _Connecting:
    """One try at torch's client, on a thread of its own: its first ping waits with no end on a
    listener that never answers (a stopped node 0), deaf to signals. A try past its timeout is
    ``stuck``: waited for, never repeated (one thread left at most)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        import_torch()
        from torch.distributed import TCPStore  # only now: importing torch takes seconds

        self._outcome: Dict[str, Any] = {}
        self._done = threading.Event()
        self._until = time.monotonic() + timeout + _CONNECT_TRY_S  # its own retries, and a margin

        def connect() -> None:
            try:
                self._outcome["store"] = TCPStore(host, port, None, False, timedelta(seconds=timeout))
            except (RuntimeError, OSError):  # torch's DistNetworkError / DistStoreError: going away
                pass
            finally:
                self._done.set()

        threading.Thread(target=connect, name="ftlaunch-connect", daemon=True).start()

    @property
    def stuck(self) -> bool:
        return not self._done.is_set() and time.monotonic() >= self._until

    def result(self, wait: Wait) -> Optional["Store"]:
        """The store once the try returns; None while it runs past its time, or failed. A signal
        ends the wait for it (SignalReceived)."""
        while not self._done.is_set() and not self.stuck and not wait.expired:
            wait.pause()
        return self._outcome.get("store")


def _listening(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _keep_alive_interval(node_timeout: float) -> int:
    """torch's handler beats every interval and drops a node after 3 missed beats: whole seconds."""
    return max(1, round(node_timeout / 3))


class Round:
    """One rendezvous round of ``size`` nodes. A restart that keeps every node holds its attempt
    on this round (torch's next one costs about a second), each attempt under keys of its own;
    every node opens the same attempts in the same order."""

    def __init__(self, store, size: int) -> None:
        self._store = store
        self.size = size
        self._attempts = 0

    def next_attempt_store(self) -> "Store":
        from torch.distributed import PrefixStore

        self._attempts += 1
        return PrefixStore(f"attempt{self._attempts}", self._store)


class Rendezvous:
    """One node's handle on the job's rendezvous: a round starts with every node in, or with MIN
    of --nnodes MIN:MAX and none more within the last call (``LAST_CALL_S``)."""

    def __init__(self, cluster: ClusterSection, run_id: str, store) -> None:
        """``run_id``: the run's id, the rendezvous' unless --rdzv-id names another."""
        import_torch()
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        # Else torch starts a second store on node 0 at every rendezvous (pytorch #135712); set
        # here, not at import, so that a single-node run's workers never see it.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.cluster = cluster
        self.store = store  # the job's store (node 0's): the lobby's keys live there too
        run_id = cluster.rdzv_id or run_id
        conf: Dict[str, Any] = {
            "join_timeout": cluster.join_timeout,
            "keep_alive_interval": _keep_alive_interval(cluster.node_timeout),
            "keep_alive_max_attempt": 3,
            # Within the join's time: else --nnodes 1:2 --join-timeout 5s times out node 0 alone.
            "last_call_timeout": min(
                STANDBY_LAST_CALL_S if cluster.standby else LAST_CALL_S, max(1, int(cluster.join_timeout / 2))
            ),
            **dict(cluster.rdzv_conf),
        }

        params = RendezvousParameters(
            backend="c10d",
            endpoint=cluster.rdzv_endpoint,
            run_id=run_id,
            min_nodes=cluster.fewest,
            max_nodes=cluster.members,
            **conf,
        )
        try:
            self._handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
        except (ValueError, TypeError) as err:
            raise UsageError(f"--rdzv-conf: {err}") from None

    def next_round(
        self, signals: SignalInbox, say: Callable[[str], None], watch: Callable[[], None] = lambda: None
    ) -> Round:
        """Block until every node has joined the next round; a signal or an error raised by
        ``watch`` (called every half second) ends the wait."""
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousGracefulExitError,
            RendezvousTimeoutError,
        )

        outcome: dict = {}

        def join() -> None:
            try:
                outcome["info"] = self._handler.next_rendezvous()
            except BaseException as err:  # handed to the waiting thread
                outcome["error"] = err

        thread = threading.Thread(target=join, name="ftlaunch-rendezvous", daemon=True)
        thread.start()
        # A backstop to torch's join timeout, for a handler stuck on a stopped node 0's store.
        wait = Wait(self.cluster.join_timeout + _ROUND_SLACK_S, signals, since=0)
        while thread.is_alive():
            wait.pause()
            if wait.expired:
                outcome.setdefault("error", RendezvousTimeoutError("the join did not return"))
                break
            if wait.due(WATCH_EVERY_S, "watch", first=0):
                watch()
            if wait.due(_SAY_EVERY_S, first=10.0):
                say(
                    f"waiting for {'at least ' if self.cluster.fewest < self.cluster.members else ''}"
                    f"{self._who()} to join "
                    f"({wait.waited:.0f} s of "
                    f"--join-timeout {self.cluster.join_timeout:g} s)"
                )
        error: Optional[BaseException] = outcome.get("error")
        n = self.cluster.nnodes
        if isinstance(error, (RendezvousClosedError, RendezvousGracefulExitError)):
            raise JobOver("the job has ended: its rendezvous is closed (node 0 finished or gave up)")
        if isinstance(error, RendezvousTimeoutError):
            some = self.cluster.fewest < self.cluster.members
            short = f"fewer than {self._who()}" if some else f"not every one of the {n} nodes"
            raise JoinTimeout(
                f"{short} joined within --join-timeout "
                f"({self.cluster.join_timeout:g} s); the same command relaunched on every node resumes "
                "the job"
            )
        if error is not None:
            raise LeaderUnreachable(f"{type(error).__name__}: {error}")
        info = outcome["info"]
        return Round(info.store, info.world_size)

    def _who(self) -> str:
        cluster = self.cluster
        if cluster.standby:
            return f"{cluster.fewest} of the {cluster.members} nodes (--standby-nodes {cluster.standby})"
        if cluster.elastic:
            return (
                f"{cluster.fewest} of the {cluster.nnodes} nodes (--nnodes {cluster.fewest}:{cluster.nnodes})"
            )
        return f"all {cluster.nnodes} nodes"

    def nodes_waiting(self) -> int:
        """Nodes that came to join after the round closed (e.g. a relaunched one): they need a
        new round. Node 0 only (its store is in this process)."""
        return self._handler.num_nodes_waiting()

    def close(self) -> None:
        """The job is over: a node that comes now learns it at once instead of waiting."""
        try:
            self._handler.set_closed()
        except Exception:  # noqa: BLE001 - the job's end must not fail on a farewell
            pass

    def drop(self) -> None:
        """Leave the rendezvous without closing it for the others (torch's shutdown() would). The
        keep-alive timer is stopped on a thread of its own (it may wait on the dead store), and
        the handler is kept: collected in the timer's thread, it would try to join itself."""
        _DROPPED.append(self._handler)
        stop = getattr(self._handler, "_stop_heartbeats", None)  # torch's own, not public API
        if stop is not None:
            threading.Thread(target=stop, name="ftlaunch-rendezvous-drop", daemon=True).start()

    def shutdown(self) -> None:
        try:
            self._handler.shutdown()
        except Exception:  # noqa: BLE001 - the store may already be gone with node 0
            pass
