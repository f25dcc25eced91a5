"""The supervisor's side of the fork server (see ``launcher.forked.zygote``): start it, ask it for
workers (or take a rank's warm spare, see ``warm_spares``), and fall back to plain spawning, with
one line saying why, whenever it cannot serve.

A forked worker is the supervisor's own child (re-parented to it, a child subreaper), so it is
waited for, signalled and stopped exactly like a spawned one: ``ForkedWorker.poll`` is waitpid.
"""

import contextlib
import dataclasses
import errno
import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from launcher.core.config import EntryKind, EntrySection
from launcher.forked.linux import die_with_parent
from launcher.forked.protocol import SINGLE_THREADED, ZYGOTE_MODULE, spare_job, store_job
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import WorkerSpec
from launcher.process.warm_spares import WarmSpares
from launcher.process.workers import ForkedWorker, PopenSpawner, Spawned, Started
from worker_lib.core import contract as c

__all__ = [
    "ForkedStore",
    "ForkServer",
    "ForkServerInterrupted",
    "ForkServerSpawner",
    "ForkServerUnavailable",
]


_MAX_MESSAGE = 1 << 16
# Workers forked per request: 2 descriptors each, under the 253 a message can carry, and their
# command lines and environments under the socket's buffer (~200 KiB; one rank's too large is said).
_BATCH = 64
_BATCH_BYTES = 128 << 10
_REAP_S = 10.0  # a SIGKILLed store host is reaped within it (the kernel has to close its sockets)
_STORE_ANSWER_S = 5.0  # the store host answers within it (a TCPStore starts in milliseconds)
# The zygote answers a request to fork (a group's workers, a spare, the store host, the processes
# forked ahead) in milliseconds: one that says nothing for this long is frozen or lost, and is
# given up on (the ranks are spawned). It was 30 s: a zygote frozen at a crash held the restart.
ANSWER_S = 5.0
# What differs between ranks or attempts is left out of the zygote's environment: an import that
# reads one of them fails there (and workers are spawned instead), rather than freezing rank 0's
# or attempt 0's value into every worker it forks.
_PER_WORKER = (
    c.RANK,
    c.LOCAL_RANK,
    c.ROLE_RANK,
    c.MASTER_ADDR,
    c.MASTER_PORT,
    c.RESTART_COUNT,
    c.ERROR_FILE,
    c.FT_ATTEMPT,
    c.FT_HEARTBEAT_FILE,
)


class ForkServerUnavailable(Exception):
    """Why the fork server cannot serve (one line); the caller spawns plainly instead."""


class ForkServerInterrupted(Exception):
    """Its start was cut short (a signal): no verdict on whether it can serve."""


@dataclasses.dataclass(frozen=True)
class Forked:
    """The answer to a request: each job's pid, None for one that died as it started (``why``)."""

    pids: List[Optional[int]]
    why: str = ""

    def one(self) -> int:
        if self.pids[0] is None:
            raise ForkServerUnavailable(self.why)
        return self.pids[0]


class StoreHostFailed(Exception):
    """The store host did not do what it was asked (one line)."""


class ForkedStoreHost:
    """The store host forked from the zygote (``launcher.forked.store_host``): our child (re-parented, like a
    forked worker) that serves the run's attempts' stores one after the other; killed and reaped
    when the run ends, or when it stops answering."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self._process = ForkedWorker(pid)

    def serve(self, listener: socket.socket) -> "ForkedStore":
        """A new store on ``listener`` (the last one closed first)."""
        addr, port = listener.getsockname()[:2]
        answer = self._ask({"serve": [addr, port]}, [listener.fileno()])
        if "serving" not in answer:
            raise StoreHostFailed(f"it could not serve on {addr}:{port} ({answer.get('error')})")
        return ForkedStore(self)

    def close_store(self) -> None:
        """The last store closed and its port free; when the host does not say so, it is killed
        (its sockets close as it dies)."""
        try:
            self._ask({"close": True}, [])
        except StoreHostFailed:
            self.stop()

    def _ask(self, request: dict, fds: List[int]) -> dict:
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            deadline = time.monotonic() + _STORE_ANSWER_S
            while not select.select([self._sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if time.monotonic() >= deadline:
                    raise StoreHostFailed(f"no answer within {_STORE_ANSWER_S:g} s")
            data = self._sock.recv(_MAX_MESSAGE)
        except OSError as err:
            raise StoreHostFailed(f"it is gone ({err.strerror or err})") from None
        if not data:
            raise StoreHostFailed("it is gone")
        return json.loads(data)

    def stop(self) -> None:
        self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # it holds nothing to save
        deadline = time.monotonic() + _REAP_S
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)


class ForkedStore:
    """One attempt's store, served by the store host (a ``HostedStore``)."""

    def __init__(self, host: ForkedStoreHost) -> None:
        self._host = host

    def stop(self) -> None:
        self._host.close_store()


def _batch(specs: List[WorkerSpec]) -> Tuple[List[WorkerSpec], List[WorkerSpec]]:
    """The next request's specs (at least one), and the rest."""
    size = 0
    for n, spec in enumerate(specs[:_BATCH]):
        size += len(json.dumps([list(spec.argv), dict(spec.env)]))
        if n and size > _BATCH_BYTES:
            return specs[:n], specs[n:]
    return specs[:_BATCH], specs[_BATCH:]


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A request for parked processes whose answer is not yet read: for which local ranks, and
    our ends of their sockets."""

    local_ranks: List[int]
    ours: List[socket.socket]


def storage_modules(url: str) -> List[str]:
    """The modules of the fsspec filesystems that serve the checkpoint URL (``gcsfs`` for
    ``gs://``; every layer of a chained ``simplecache::gs://`` URL), named without importing
    them. The zygote imports them: gcsfs alone costs 0.4 s, which every rank of every restart
    would pay again."""
    from fsspec.core import split_protocol
    from fsspec.registry import known_implementations

    *outer, inner = url.split("::")
    protocols = [*outer, split_protocol(inner)[0] or "file"]  # outer layers are bare names
    found = (known_implementations.get(p) for p in protocols)
    return [f["class"].rsplit(".", 1)[0] for f in found if f is not None]


class ForkServer:
    """One zygote per supervisor, started before the first attempt with the first rank's
    environment, less what differs between ranks and attempts."""

    def __init__(self, entry: EntrySection, log_file: Path, ignored=(), preload: Sequence[str] = ()) -> None:
        self._entry = entry
        self._preload = list(preload)  # --preload: more modules, imported once for every worker
        self._log_file = log_file
        self._ignored = tuple(ignored)
        self._sock: Optional[socket.socket] = None
        self._proc: Optional[subprocess.Popen] = None
        self._launched_at = 0.0
        self.import_s: Optional[float] = None  # how long its imports took: what each new process pays
        self._ahead: Optional[_Ahead] = None  # send_parked's request, its answer not yet read
        self._parked: List[Tuple[int, int, socket.socket]] = []  # answered for, not yet taken

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def launch(self, env: dict) -> None:
        """Start the zygote without waiting for its imports (OSError if it cannot be started)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        module = self._entry.kind is EntryKind.MODULE
        spec = {
            "script": "" if module else self._entry.entrypoint,
            "module": self._entry.entrypoint if module else "",
            "supervisor": os.getpid(),
            "rank_vars": list(_PER_WORKER),
            "preload": self._preload,
            "storage": storage_modules(env.get(c.FT_CHECKPOINT_URL, "")),
        }
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_file, "ab") as out, theirs:
            argv = [self._entry.python, "-u", "-m", ZYGOTE_MODULE, str(theirs.fileno())]
            self._proc = subprocess.Popen(
                [*argv, json.dumps(spec)],
                env={**{k: v for k, v in env.items() if k not in _PER_WORKER}, **SINGLE_THREADED},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # a Ctrl+C in the terminal is the supervisor's to act on
                preexec_fn=die_with_parent(ignore=self._ignored),
            )
        self._sock = ours
        self._launched_at = time.monotonic()

    def await_ready(self, timeout: float, go_on: Callable[[], bool] = lambda: True) -> None:
        """Wait until the launched zygote has imported everything; ForkServerUnavailable when it
        cannot serve (a module that fails to import, a thread left behind, a death)."""
        ready = self._receive(timeout, "start", go_on)
        self.import_s = time.monotonic() - self._launched_at
        if ready.get("reads"):  # first: a failed import of such a module says less
            name, read = next(iter(ready["reads"].items()))
            raise ForkServerUnavailable(
                f"importing {name} reads {', '.join(read)} (a rank's own) at import: made once for "
                "every rank, it would keep one value for all"
            )
        if ready["failed"]:
            name, why = next(iter(ready["failed"].items()))
            raise ForkServerUnavailable(f"it could not import {name} ({why})")
        if ready["cuda"]:
            raise ForkServerUnavailable(
                "an import initialized CUDA or its driver, which a fork cannot inherit"
            )
        if ready["threads"] != 1:
            raise ForkServerUnavailable(f"importing left {ready['threads'] - 1} thread(s) running in it")

    def fork(
        self, specs: Sequence[WorkerSpec], pipes: Sequence[Tuple[int, int]], timeout: float = ANSWER_S
    ) -> Forked:
        """A worker per spec, in one request, with the write ends of its stdout and stderr pipes;
        each one's pid, None for one that died as it started."""
        cwd = os.getcwd()
        jobs = [{"argv": list(spec.argv), "env": dict(spec.env), "cwd": cwd} for spec in specs]
        return self._forked(jobs, [list(pair) for pair in pipes], timeout)

    def fork_store(self, timeout: float = ANSWER_S) -> Tuple[int, socket.socket]:
        """The store host (``launcher.forked.store_host``): its pid, and our end of its socket."""
        return self._fork_helper(store_job(), timeout)

    def fork_spare(
        self, local_rank: int, cuda: bool, slots: Optional[dict] = None, timeout: float = ANSWER_S
    ) -> Tuple[int, socket.socket]:
        """A warm spare for ``local_rank`` (``parked_spare``): its pid, and our end of the socket it is
        handed its rank through. ``slots``: the memory-tier slots it maps ahead (``parked_spare.park``)."""
        return self._fork_helper(spare_job(local_rank, cuda, slots), timeout)

    def send_parked(self, local_ranks: List[int]) -> None:
        """Ask for a spare without CUDA per local rank, without waiting: the zygote forks them
        while the caller goes on, and ``settle`` reads its answer. One such request at a time."""
        if self._ahead is not None:
            return
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in local_ranks]
        try:
            with open(self._log_file, "ab") as log:
                fds = [[log.fileno(), log.fileno(), theirs.fileno()] for _, theirs in pairs]
                self._send([spare_job(rank, False, None) for rank in local_ranks], fds)
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for _, theirs in pairs:  # the request carries its own copies
                theirs.close()
        self._ahead = _Ahead(list(local_ranks), [ours for ours, _ in pairs])

    def settle(self, timeout: float = ANSWER_S, go_on: Callable[[], bool] = lambda: True) -> None:
        """Read the answer to the request sent ahead, if one is pending: waited for up to
        ``timeout`` s, or with 0 read only if it is there. What it made goes to ``take_parked``.
        Answers come in the order of the requests, so every other request settles it first."""
        ahead = self._ahead
        if ahead is None or (timeout <= 0 and not select.select([self._connected()[0]], [], [], 0)[0]):
            return
        answer = self._receive(max(timeout, 1.0), "fork", go_on)  # with 0: it is there, read at once
        self._ahead = None
        pids = answer.get("pids") or [None] * len(ahead.ours)
        for rank, ours, pid in zip(ahead.local_ranks, ahead.ours, pids):
            if pid is None:
                ours.close()  # it died as it started, or was never made
            else:
                self._parked.append((rank, pid, ours))
        if "pids" not in answer:
            raise ForkServerUnavailable(answer.get("error", f"it answered {answer}"))

    def take_parked(self) -> List[Tuple[int, int, socket.socket]]:
        """The processes made ahead and answered for since the last call: (local rank, pid, our
        end of its socket), the caller's from now on."""
        parked, self._parked = self._parked, []
        return parked

    def _fork_helper(self, job: dict, timeout: float) -> Tuple[int, socket.socket]:
        """A helper of ours (a store host, a spare): its pid, and our end of a socket pair of its
        own. Its output goes to the fork server's log."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(self._log_file, "ab") as log, theirs:
                fds = [log.fileno(), log.fileno(), theirs.fileno()]
                return self._forked([job], [fds], timeout).one(), ours
        except BaseException:
            ours.close()
            raise

    def _connected(self) -> Tuple[socket.socket, subprocess.Popen]:
        """Its socket and process, once launched (a defect to ask before)."""
        if self._sock is None or self._proc is None:
            raise ForkServerUnavailable("it was not launched")
        return self._sock, self._proc

    def _forked(self, jobs: List[dict], fds: List[List[int]], timeout: float) -> "Forked":
        self.settle(timeout)  # its answer comes first
        self._send(jobs, fds)
        answer = self._receive(timeout, "fork")
        if "pids" not in answer:
            raise ForkServerUnavailable(answer.get("error", f"it answered {answer}"))
        return Forked(answer["pids"], answer.get("error", ""))

    def _send(self, jobs: List[dict], fds: List[List[int]]) -> None:
        payload = json.dumps({"jobs": jobs, "fds": [len(own) for own in fds]}).encode()
        try:
            socket.send_fds(self._connected()[0], [payload], [fd for own in fds for fd in own])
        except OSError as err:
            if err.errno == errno.EMSGSIZE:  # one datagram: the socket's buffer (~200 KiB) bounds it
                raise ForkServerUnavailable(
                    f"the worker's command line and environment ({len(payload) // 1024} KiB) are more "
                    "than one request to it can carry"
                ) from None
            raise ForkServerUnavailable(f"it stopped answering ({err.strerror or err})") from None

    def _receive(self, timeout: float, what: str, go_on: Callable[[], bool] = lambda: True) -> dict:
        deadline = time.monotonic() + timeout
        sock, proc = self._connected()
        while True:
            if not go_on():
                raise ForkServerInterrupted()
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready:
                try:
                    data = sock.recv(_MAX_MESSAGE)
                except OSError:  # reset: it died with a request of ours unread
                    data = b""
                if data:
                    return json.loads(data)
                raise ForkServerUnavailable(f"it died (exit {proc.wait()}; see {self._log_file})")
            if proc.poll() is not None:
                raise ForkServerUnavailable(f"it died (exit {proc.returncode}; see {self._log_file})")
            if time.monotonic() > deadline:
                raise ForkServerUnavailable(f"no answer to {what} within {timeout:g} s")

    def close(self) -> None:
        # Processes made ahead and never taken read EOF on their sockets and leave.
        for ours in self._ahead.ours if self._ahead is not None else []:
            ours.close()
        for _, _, ours in self.take_parked():
            ours.close()
        self._ahead = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class ForkServerSpawner:
    """Forks workers from the zygote while it serves (a rank's warm spare first, when there is
    one); from the first time it cannot, spawns them plainly (and says so once). The run never
    fails because of the fork server."""

    def __init__(
        self,
        server: ForkServer,
        fallback: PopenSpawner,
        say: Callable[[str], None],
        spares: WarmSpares,
    ) -> None:
        self._server = server
        self._fallback = fallback
        self._say = say
        self._spares = spares
        self._state = "new"  # new → (launched →) serving | off
        self._store_host: Optional[ForkedStoreHost] = None  # once this node hosts a store
        self._guard: Optional[OrphanGuard] = None  # the run's, once an attempt is prepared
        self._slots: Dict[int, dict] = {}  # local rank → its memory-tier slots, as the last plan had them

    @property
    def helper_pids(self) -> Tuple[int, ...]:
        pid = self._server.pid if self._state in ("launched", "serving") else None
        store = self._store_host.pid if self._store_host is not None else None
        return tuple(p for p in (pid, store) if p is not None) + self._spares.pids

    def host_store(self, listener: socket.socket, go_on: Callable[[], bool]) -> Optional[ForkedStore]:
        """The attempt's store served by the store host (forked from the zygote the first time);
        None when there is none (this process serves the store then)."""
        if self._state == "launched":
            self._start(None, go_on)
        failed = ""
        for _ in range(2):  # the host that served the last attempt, else (or once it failed) a new one
            host = self._store_host or self._fork_store_host()
            if host is None:
                return None
            try:
                return host.serve(listener)
            except StoreHostFailed as err:
                host.stop()
                self._store_host, failed = None, str(err)
        self._say(f"store host: {failed}; ftlaunch serves the workers' store itself")
        return None

    def _fork_store_host(self) -> Optional[ForkedStoreHost]:
        if self._state == "serving":
            try:
                self._store_host = ForkedStoreHost(*self._server.fork_store())
            except (ForkServerUnavailable, OSError) as err:
                self._give_up(str(err))
        return self._store_host

    def warm_up(self, spec: WorkerSpec) -> None:
        if self._state == "new":
            try:
                self._server.launch(dict(spec.env))
                self._state = "launched"
            except OSError as err:
                self._give_up(str(err))

    def prepare(self, specs: Sequence[WorkerSpec], guard: OrphanGuard, go_on: Callable[[], bool]) -> None:
        """The zygote ready and, before the first attempt, a warm spare per local rank (measured
        and said). Later spares are made while an attempt runs (``refill``): made here, a rank
        without one would wait for a fork it could have had with its group's in one request."""
        first = self._guard is None
        self._guard = guard
        self._note_slots(specs)
        if self._state in ("new", "launched"):
            self._start(specs[0], go_on)
        while first and self.refill():
            pass
        self._spares.say_cost_once(go_on)

    def refill(self) -> bool:
        if self._state != "serving" or self._guard is None:
            return False
        try:
            return self._spares.make_one(
                lambda rank, cuda: self._server.fork_spare(rank, cuda, self._slots.get(rank)), self._guard
            )
        except ForkServerUnavailable as err:
            self._give_up(str(err))
        except OSError as err:  # the fork server's log cannot be opened for it
            self._spares.turn_off(str(err))
        return False

    def fork_ahead(self) -> None:
        missing = self._spares.missing_ahead() if self._state == "serving" else []
        if not missing:
            return
        try:
            self._server.send_parked(missing)
        except ForkServerUnavailable as err:
            self._give_up(str(err))
        except OSError as err:  # the fork server's log cannot be opened for them
            self._spares.turn_off(str(err))

    def settle_ahead(self, timeout: float = 0.0, go_on: Callable[[], bool] = lambda: True) -> None:
        if self._state != "serving" or self._guard is None:
            return
        why = ""
        try:
            self._server.settle(timeout, go_on)
        except ForkServerInterrupted:  # a signal: its answer is read by the next request
            pass
        except ForkServerUnavailable as err:
            why = str(err)
        for rank, pid, sock in self._server.take_parked():
            self._spares.add_parked(rank, pid, sock, self._guard)
        if why:
            self._give_up(why)

    def spawn(
        self, specs: Sequence[WorkerSpec], go_on: Callable[[], bool] = lambda: True
    ) -> Iterator[Started]:
        """Each rank from its warm spare (or the process forked ahead for it) if it has one, the
        others forked in requests of up to ``_BATCH``; from the first request the fork server
        cannot serve, the rest spawned."""
        if self._state in ("new", "launched"):
            self._start(specs[0], lambda: True)
        self._note_slots(specs)
        self.settle_ahead(ANSWER_S, go_on)  # what the last group's stop made ahead, once made
        left = list(specs)
        if self._state == "serving" and self._spares.pids:
            left = []
            for spec in specs:
                if not go_on():
                    return
                spawned = self._from_spare(spec, go_on)
                if spawned is None:
                    left.append(spec)
                else:
                    yield spec, spawned
        while left and self._state == "serving":
            if not go_on():
                return
            batch, left = _batch(left)
            forked, why = self._fork(batch)
            yield from forked
            if why:
                self._give_up(why)
                started = {spec.rank for spec, _ in forked}
                left = [spec for spec in batch if spec.rank not in started] + left
        yield from self._fallback.spawn(left, go_on)

    def _note_slots(self, specs: Sequence[WorkerSpec]) -> None:
        """Where each local rank's memory-tier slots are (its rank and the node's folder), for the
        spares made from now on: the next attempt's ranks are most often this one's."""
        self._slots = {
            spec.local_rank: {"folder": spec.env[c.FT_MEMORY_DIR], "rank": spec.rank}
            for spec in specs
            if spec.env.get(c.FT_MEMORY_DIR)
        }

    def _from_spare(self, spec: WorkerSpec, go_on: Callable[[], bool]) -> Optional[Spawned]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        worker = None
        try:
            worker = self._spares.take(spec, out_w, err_w, go_on)
        finally:
            os.close(out_w)
            os.close(err_w)
            if worker is None:
                os.close(out_r)
                os.close(err_r)
        return Spawned(worker, out_r, err_r) if worker is not None else None

    def _fork(self, specs: List[WorkerSpec]) -> Tuple[List[Started], str]:
        """One request for ``specs``: the ones forked, and why the others were not ('' when all
        were)."""
        pipes = [(os.pipe(), os.pipe()) for _ in specs]  # (stdout's (read, write), stderr's)
        try:
            forked = self._server.fork(specs, [(stdout[1], stderr[1]) for stdout, stderr in pipes])
        except ForkServerUnavailable as unavailable:
            forked = Forked([None] * len(specs), str(unavailable))
        finally:
            for stdout, stderr in pipes:  # ours of the write ends: a worker's exit then ends its reads
                os.close(stdout[1])
                os.close(stderr[1])
        started = []
        for spec, pid, (stdout, stderr) in zip(specs, forked.pids, pipes):
            if pid is None:
                os.close(stdout[0])
                os.close(stderr[0])
            else:
                started.append((spec, Spawned(ForkedWorker(pid), stdout[0], stderr[0])))
        return started, forked.why

    def _start(self, spec: Optional[WorkerSpec], go_on: Callable[[], bool]) -> None:
        try:
            if self._state == "new" and spec is not None:  # the first worker's environment
                self._server.launch(dict(spec.env))
            self._server.await_ready(timeout=300.0, go_on=go_on)
            self._state = "serving"
        except ForkServerInterrupted:
            self._server.close()  # the attempt will not start; a later one may start it again
            self._state = "new"
        except (ForkServerUnavailable, OSError) as err:
            self._give_up(str(err))

    def _give_up(self, why: str) -> None:
        self._state = "off"
        self._spares.close()  # they would outlive the zygote: the supervisor's children
        self._server.close()
        cost = self._server.import_s
        paid = f" (each imports what it imported: {cost:.1f} s here)" if cost is not None else ""
        self._say(f"fork server off: {why}; starting workers as new processes{paid}")

    def close(self) -> None:
        if self._state == "serving" and self._guard is not None:
            # What was made ahead is killed and reaped with the spares; the run ends: nothing to say.
            with contextlib.suppress(ForkServerUnavailable, ForkServerInterrupted):
                self._server.settle(2.0)
            for rank, pid, sock in self._server.take_parked():
                self._spares.add_parked(rank, pid, sock, self._guard)
        self._spares.close()
        if self._store_host is not None:
            self._store_host.stop()
            self._store_host = None
        self._server.close()
