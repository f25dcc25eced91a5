"""The supervisor's side of the fork server (see ``zygote``): start it, ask it for workers (or take
a rank's warm spare, see ``spares``), and fall back to plain spawning, with one line saying why,
whenever it cannot serve.

A forked worker is the supervisor's own child (re-parented to it, a child subreaper), so it is
waited for, signalled and stopped exactly like a spawned one: ``ForkedWorker.poll`` is waitpid.
"""

import contextlib
import errno
import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from launcher.core.config import EntryKind, EntrySection
from launcher.process.linux import die_with_parent
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import WorkerSpec
from launcher.process.spares import WarmSpares
from launcher.process.workers import ForkedWorker, PopenSpawner, Spawned, with_output_pipes
from worker_lib.core import contract as c

__all__ = [
    "ForkedStore",
    "ForkServer",
    "ForkServerInterrupted",
    "ForkServerSpawner",
    "ForkServerUnavailable",
]


_MAX_MESSAGE = 1 << 16
_REAP_S = 10.0  # a SIGKILLed store host is reaped within it (the kernel has to close its sockets)
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


class ForkedStore:
    """A store host forked from the zygote: our child (re-parented, like a forked worker), killed
    and reaped when its attempt's store closes."""

    def __init__(self, pid: int, registry: List["ForkedStore"]) -> None:
        self.pid = pid
        self._process = ForkedWorker(pid)
        self._registry = registry

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # it holds nothing to save
        deadline = time.monotonic() + _REAP_S
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self._registry.remove(self)


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

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def launch(self, env: dict) -> None:
        """Start the zygote without waiting for its imports (OSError if it cannot be started)."""
        from launcher.process.zygote import SINGLE_THREADED

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
            argv = [self._entry.python, "-u", "-m", "launcher.process.zygote", str(theirs.fileno())]
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

    def fork(self, spec: WorkerSpec, stdout_w: int, stderr_w: int, timeout: float = 30.0) -> int:
        request = {"argv": list(spec.argv), "env": dict(spec.env), "cwd": os.getcwd()}
        return self._forked(request, [stdout_w, stderr_w], timeout)

    def fork_store(self, listener: socket.socket, timeout: float = 30.0) -> int:
        """A process serving the workers' store on ``listener`` (``store_host``); its output goes
        to the fork server's log."""
        addr, port = listener.getsockname()[:2]
        request = {
            "argv": ["ftlaunch-store", addr, str(port)],  # what ps shows
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "store": [addr, port],
        }
        with open(self._log_file, "ab") as log:
            return self._forked(request, [log.fileno(), log.fileno(), listener.fileno()], timeout)

    def fork_spare(self, local_rank: int, cuda: bool, timeout: float = 30.0) -> Tuple[int, socket.socket]:
        """A warm spare for ``local_rank`` (``spare``): its pid, and our end of the socket it is
        handed its rank through. Its output goes to the fork server's log until then."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {
            "argv": ["ftlaunch-spare", str(local_rank)],  # what ps shows
            "spare": {"local_rank": local_rank, "cuda": cuda},  # the rank's env and cwd come with it
        }
        try:
            with open(self._log_file, "ab") as log, theirs:
                return self._forked(request, [log.fileno(), log.fileno(), theirs.fileno()], timeout), ours
        except BaseException:
            ours.close()
            raise

    def _connected(self) -> Tuple[socket.socket, subprocess.Popen]:
        """Its socket and process, once launched (a defect to ask before)."""
        if self._sock is None or self._proc is None:
            raise ForkServerUnavailable("it was not launched")
        return self._sock, self._proc

    def _forked(self, request: dict, fds: List[int], timeout: float) -> int:
        payload = json.dumps(request).encode()
        try:
            socket.send_fds(self._connected()[0], [payload], fds)
        except OSError as err:
            if err.errno == errno.EMSGSIZE:  # one datagram: the socket's buffer (~200 KiB) bounds it
                raise ForkServerUnavailable(
                    f"the worker's command line and environment ({len(payload) // 1024} KiB) are more "
                    "than one request to it can carry"
                ) from None
            raise ForkServerUnavailable(f"it stopped answering ({err.strerror or err})") from None
        answer = self._receive(timeout, "fork")
        if "error" in answer:
            raise ForkServerUnavailable(answer["error"])
        return int(answer["pid"])

    def _receive(self, timeout: float, what: str, go_on: Callable[[], bool] = lambda: True) -> dict:
        deadline = time.monotonic() + timeout
        sock, proc = self._connected()
        while True:
            if not go_on():
                raise ForkServerInterrupted()
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready:
                data = sock.recv(_MAX_MESSAGE)
                if data:
                    return json.loads(data)
                raise ForkServerUnavailable(f"it died (exit {proc.wait()}; see {self._log_file})")
            if proc.poll() is not None:
                raise ForkServerUnavailable(f"it died (exit {proc.returncode}; see {self._log_file})")
            if time.monotonic() > deadline:
                raise ForkServerUnavailable(f"no answer to {what} within {timeout:g} s")

    def close(self) -> None:
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
        self._stores: List[ForkedStore] = []  # store hosts forked and not yet stopped
        self._guard: Optional[OrphanGuard] = None  # the run's, once an attempt is prepared

    @property
    def helper_pids(self) -> Tuple[int, ...]:
        pid = self._server.pid if self._state in ("launched", "serving") else None
        stores = tuple(store.pid for store in self._stores)
        return ((pid,) if pid is not None else ()) + stores + self._spares.pids

    def host_store(self, listener: socket.socket, go_on: Callable[[], bool]) -> Optional[ForkedStore]:
        """The attempt's store served by a process forked from the zygote, once it is ready; None
        when it cannot serve (this process hosts the store then)."""
        if self._state == "launched":
            self._start(None, go_on)
        if self._state != "serving":
            return None
        try:
            store = ForkedStore(self._server.fork_store(listener), self._stores)
        except ForkServerUnavailable as err:
            self._give_up(str(err))
            return None
        self._stores.append(store)
        return store

    def warm_up(self, spec: WorkerSpec) -> None:
        if self._state == "new":
            try:
                self._server.launch(dict(spec.env))
                self._state = "launched"
            except OSError as err:
                self._give_up(str(err))

    def prepare(self, specs: Sequence[WorkerSpec], guard: OrphanGuard, go_on: Callable[[], bool]) -> None:
        """The zygote ready, and a warm spare per local rank (the first ones measured and said)."""
        self._guard = guard
        if self._state in ("new", "launched"):
            self._start(specs[0], go_on)
        while self.refill():
            pass
        self._spares.say_cost_once(go_on)

    def refill(self) -> bool:
        if self._state != "serving" or self._guard is None:
            return False
        try:
            return self._spares.make_one(self._server.fork_spare, self._guard)
        except ForkServerUnavailable as err:
            self._give_up(str(err))
        except OSError as err:  # the fork server's log cannot be opened for it
            self._spares.turn_off(str(err))
        return False

    def spawn(self, spec: WorkerSpec, go_on: Callable[[], bool] = lambda: True) -> Spawned:
        if self._state in ("new", "launched"):
            self._start(spec, lambda: True)
        if self._state == "serving":
            try:
                return self._fork(spec, go_on)
            except ForkServerUnavailable as err:
                self._give_up(str(err))
        return self._fallback.spawn(spec)

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

    def _fork(self, spec: WorkerSpec, go_on: Callable[[], bool]) -> Spawned:
        def start(out_w: int, err_w: int) -> ForkedWorker:
            spare = self._spares.take(spec, out_w, err_w, go_on)
            return spare or ForkedWorker(self._server.fork(spec, out_w, err_w))

        return with_output_pipes(start)

    def _give_up(self, why: str) -> None:
        self._state = "off"
        self._spares.close()  # they would outlive the zygote: the supervisor's children
        self._server.close()
        cost = self._server.import_s
        paid = f" (each imports what it imported: {cost:.1f} s here)" if cost is not None else ""
        self._say(f"fork server off: {why}; starting workers as new processes{paid}")

    def close(self) -> None:
        self._spares.close()
        for store in list(self._stores):
            store.stop()
        self._server.close()
