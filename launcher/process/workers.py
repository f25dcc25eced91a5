"""Process mechanics of one attempt's worker group: spawn → poll → stop. No policy here."""

import dataclasses
import os
import socket
import subprocess
import time
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Set, Tuple

from launcher.core import failpoints
from launcher.forked.linux import die_with_parent
from launcher.process.attempt_store import HostedStore
from launcher.process.logs import LogPump
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import WorkerSpec
from launcher.process.tree import DescendantLook, StopReport, descendants, process_status, stop_tree

# After the stack-dump signal, before SIGTERM: a pending SIGTERM would be delivered first (Linux
# delivers lower-numbered signals first) and kill the worker before faulthandler writes.
_STACK_DUMP_WAIT_S = 0.5
_GROUP_LOOK_S = 0.5  # how often descendants are looked at for groups of their own
# The spawner makes again what a start used (warm spares) only this long after the start: forks
# then would take CPU from the new group's own start (its rendezvous, load and first step), the
# part of a restart that is left once the workers are forked.
_REFILL_AFTER_S = 1.0

__all__ = [
    "Exit",
    "ForkedWorker",
    "PopenSpawner",
    "Spawned",
    "Spawner",
    "Started",
    "WorkerGroup",
    "WorkerProcess",
    "with_output_pipes",
]


class WorkerProcess(Protocol):
    """What the group needs of a started worker (``subprocess.Popen`` is one)."""

    pid: int

    def poll(self) -> Optional[int]: ...


@dataclasses.dataclass(frozen=True)
class Spawned:
    process: WorkerProcess
    stdout_fd: int  # read ends of the worker's pipes; the log pump owns and closes them
    stderr_fd: int


Started = Tuple[WorkerSpec, Spawned]


class Spawner(Protocol):
    """How workers are started; one small interface so a faster way (a fork server that has
    already imported torch) can replace plain exec without touching the group."""

    def spawn(
        self, specs: Sequence[WorkerSpec], go_on: Callable[[], bool] = lambda: True
    ) -> Iterator[Started]:
        """Start each of ``specs``' ranks, yielding each as soon as it has started (the caller
        owns what was yielded, even when a later start raises). ``go_on()`` is asked before each
        piece of the start (a rank, or a request for many): once it turns false (a signal), the
        rest are not started."""
        ...

    def warm_up(self, spec: WorkerSpec) -> None:
        """May start warming up for ``spec`` (rank 0's, less what differs per attempt) without
        waiting, so that this overlaps with the supervisor's own set-up for the attempt."""
        ...

    def prepare(self, specs: Sequence[WorkerSpec], guard: OrphanGuard, go_on: Callable[[], bool]) -> None:
        """Called before an attempt's clock starts, with its ranks' specs: a fork server warms up
        here (and makes its warm spares, watched by ``guard``), so its imports never count as the
        group's life. ``go_on()`` turning false (a signal) cuts the wait short."""
        ...

    def refill(self) -> bool:
        """Called while the group runs, once every rank has started: make again one thing the
        next start will use (a warm spare), its slow part in the background. Returns whether
        more remain to make (one at a time: the supervisor's loop is never held for long)."""
        ...

    def fork_ahead(self) -> None:
        """Called once a failed group was told to stop: have made now, while it exits, what the
        restart would otherwise make while its ranks wait (a process per local rank, parked until
        its rank's start). Never waits: ``settle_ahead`` takes what was made."""
        ...

    def settle_ahead(self) -> None:
        """Take what ``fork_ahead`` had made, if it is made; never waits (every ``poll``)."""
        ...

    @property
    def helper_pids(self) -> Tuple[int, ...]:
        """Our own processes among the supervisor's children (a fork server, a store host, parked
        processes): never stopped with a group."""
        ...

    def host_store(self, listener: socket.socket, go_on: Callable[[], bool]) -> Optional[HostedStore]:
        """Serve the attempt's store on ``listener`` in a process of the spawner's, or None: the
        supervisor serves it itself."""
        ...


class PopenSpawner:
    """fork + exec of ``spec.argv``, in its own session (so its tree is one process group),
    dying with the supervisor (PR_SET_PDEATHSIG), stdin from /dev/null, ``ignored`` signals
    (the preemption notice) ignored."""

    def __init__(self, ignored: Sequence[int] = ()) -> None:
        self._ignored = tuple(ignored)

    def warm_up(self, spec: WorkerSpec) -> None:
        pass  # nothing to warm up

    def prepare(self, specs: Sequence[WorkerSpec], guard: OrphanGuard, go_on: Callable[[], bool]) -> None:
        pass

    def refill(self) -> bool:
        return False

    def fork_ahead(self) -> None:
        pass  # an exec costs the same now or later

    def settle_ahead(self) -> None:
        pass

    @property
    def helper_pids(self) -> Tuple[int, ...]:
        return ()

    def host_store(self, listener: socket.socket, go_on: Callable[[], bool]) -> Optional[HostedStore]:
        return None

    def spawn(
        self, specs: Sequence[WorkerSpec], go_on: Callable[[], bool] = lambda: True
    ) -> Iterator[Started]:
        for spec in specs:
            if not go_on():
                return
            yield spec, self._spawn(spec)

    def _spawn(self, spec: WorkerSpec) -> Spawned:
        def start(stdout_w: int, stderr_w: int) -> WorkerProcess:
            return subprocess.Popen(
                spec.argv,
                env=dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=stdout_w,
                stderr=stderr_w,
                start_new_session=True,
                preexec_fn=die_with_parent(ignore=self._ignored),
            )

        return with_output_pipes(start)


def with_output_pipes(start: Callable[[int, int], WorkerProcess]) -> Spawned:
    """Start a worker with the write ends of two new pipes as its stdout and stderr; the read
    ends go to the log pump, ours of the write ends are closed (its exit then ends the pump's
    reads)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        process = start(out_w, err_w)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return Spawned(process, out_r, err_r)


class ForkedWorker:
    """A worker the zygote forked (or a spare it made): our child once re-parented, so waitpid
    works on it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for "killed by signal N"
        return self.returncode


@dataclasses.dataclass(frozen=True)
class Exit:
    spec: WorkerSpec
    pid: int
    exitcode: int
    observed_at: float  # time.monotonic()


class WorkerGroup:
    def __init__(
        self,
        specs: List[WorkerSpec],
        spawner: Spawner,
        pump: LogPump,
        guard: OrphanGuard,
        to_console: Callable[[int], bool],
    ) -> None:
        self.specs = specs
        self._spawner = spawner
        self._pump = pump
        self._guard = guard
        self._to_console = to_console
        self._procs: Dict[int, WorkerProcess] = {}  # rank -> process
        self._exits: Dict[int, Exit] = {}  # rank -> how it ended
        self._other_groups: Set[int] = set()  # groups descendants made of their own
        self._next_look = 0.0
        self._descendants = DescendantLook(
            lambda: descendants({self._guard.pid, *self._spawner.helper_pids}, our_main_thread_only=True)
        )
        self._refill_at: Optional[float] = None  # from then on, the spawner makes again what the start used

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self._procs.values()]

    def prepare(self, go_on: Callable[[], bool] = lambda: True) -> None:
        """Before the group's clock starts: the spawner gets ready for these ranks (see
        ``Spawner.prepare``)."""
        self._spawner.prepare(self.specs, self._guard, go_on)

    def spawn(self, go_on: Callable[[], bool] = lambda: True) -> None:
        """Start every rank while ``go_on()`` (asked before each piece of the start) says so: a
        signal during the start of many ranks stops the rest from starting. Once all have
        started, and a moment after, the spawner makes again what their start used, a piece per
        ``poll``."""
        for spec, spawned in self._spawner.spawn(self.specs, go_on):
            self._procs[spec.rank] = spawned.process
            self._guard.watch(spawned.process.pid)
            log_file = self._pump.open_log(spec.log_file)  # None: a full disk, the console only
            show = self._to_console(spec.rank)
            self._pump.add(spawned.stdout_fd, "stdout", spec.rank, log_file, show)
            self._pump.add(spawned.stderr_fd, "stderr", spec.rank, log_file, show)
        if len(self._procs) == len(self.specs):  # not after a start cut short
            self._refill_at = time.monotonic() + _REFILL_AFTER_S

    def poll(self) -> List[Exit]:
        """Workers that exited since the last poll, in rank order. While none did, the spawner
        makes one more piece of the next start (``Spawner.refill``): after the group is running,
        never more than one fork's time per look."""
        now = time.monotonic()
        self._spawner.settle_ahead()  # made ahead during a stop: known as helpers once made
        new = []
        for spec in self.specs:
            proc = self._procs.get(spec.rank)
            if proc is None or spec.rank in self._exits:
                continue
            code = proc.poll()
            if code is not None:
                self._exits[spec.rank] = Exit(spec, proc.pid, code, now)
                new.append(self._exits[spec.rank])
        if self._refill_at is not None and now >= self._refill_at and not new:
            self._refill_at = self._refill_at if self._spawner.refill() else None
        return new

    def running(self) -> Dict[int, int]:
        """Rank → pid of every worker not yet seen to exit."""
        return {rank: proc.pid for rank, proc in self._procs.items() if rank not in self._exits}

    def dump_stacks(self, signals: Mapping[int, Tuple[int, int]]) -> Dict[int, str]:
        """Has every live rank that registered a dump signal write all its threads' stacks to its
        log (the hung ones, and the peers they left waiting, which show where the group stood).
        ``signals``: rank → (the pid that registered it, the signal). Returns each running rank's
        process state afterwards ("stopped": the evidence of a SIGSTOP; "": gone)."""
        signalled = False
        for rank, pid in self.running().items():
            registered = signals.get(rank)
            if registered is not None and registered[0] == pid:
                try:
                    os.kill(pid, registered[1])
                    signalled = True
                except ProcessLookupError:
                    pass
        if signalled:
            time.sleep(_STACK_DUMP_WAIT_S)
        return {rank: process_status(pid) for rank, pid in self.running().items()}

    def all_exited(self) -> bool:
        return len(self._exits) == len(self.specs)

    def guard_new_groups(self) -> List[int]:
        """Descendants that made a process group of their own (setsid, setpgid) left the workers'
        groups: the orphan guard is told of theirs too (looked for every half second), so that a
        kill -9 of the supervisor takes them with it. Returns the groups newly guarded."""
        now = time.monotonic()
        if now < self._next_look:
            return []
        self._next_look = now + _GROUP_LOOK_S
        known = {*self.pids, *self._other_groups, os.getpgid(0)}
        new = []
        for pid in self._descendants():
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            if pgid not in known:
                known.add(pgid)
                new.append(pgid)
                self._other_groups.add(pgid)
                self._guard.watch(pgid)
        return new

    def stop(
        self, first_signal: int, grace: float, abort: Callable[[], bool], restarting: bool = False
    ) -> StopReport:
        """Stop every worker and every descendant, reap them, and release their groups. When a
        restart is likely (``restarting``), the spawner forks the next group's processes while
        this one exits (``Spawner.fork_ahead``); nothing else is made meanwhile."""
        self._refill_at = None

        def signalled() -> None:
            if restarting:
                self._spawner.fork_ahead()
            failpoints.reached("stop-signalled")

        report = stop_tree(
            self.pids,
            first_signal,
            grace,
            abort,
            exclude=lambda: {self._guard.pid, *self._spawner.helper_pids},
            reap=self.poll,
            meanwhile=signalled,
        )
        for pgid in [*self.pids, *self._other_groups]:
            self._guard.forget(pgid)
        return report
