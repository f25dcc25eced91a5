"""Warm spares, from the supervisor's side (``launcher.forked.parked_spare`` is the spare's own):
one parked process per local rank, forked from the zygote before a start; the rank's start takes
it (the spare becomes the worker, its pid the worker's), and a new one is made once the group has
started, its CUDA context in the background.

A parked spare is the supervisor's child, in a session of its own, dying with the supervisor
(PR_SET_PDEATHSIG, and the orphan guard watches its group, as a worker's). It is one of the
spawner's helpers (never stopped with a group) until it is taken; ``close`` kills the rest. Any
trouble with a spare (its warm-up failed, it died, it refused its rank) turns spares off for the
run, said in one line; ranks then start as forks of the zygote, as without spares.
"""

import contextlib
import enum
import errno
import json
import os
import select
import signal
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import WorkerSpec
from launcher.process.workers import ForkedWorker

__all__ = ["Spare", "SpareFailed", "SpareState", "WarmSpares"]

_MAX_MESSAGE = 1 << 16
_READY_S = 120.0  # a CUDA context within it (seconds on a busy 8-GPU node), or spares go off
# Without CUDA a parked process is ready once forked and answers its hand-over at once (ms): one
# that says nothing for this long (a frozen one) is let go and its rank started anew, and forking
# ahead goes off.
_PARKED_ANSWER_S = 5.0
# A spare with CUDA answers its hand-over at once, or once it has registered the slot of its rank's
# it is registering (about 8 GB/s: 10 s is 80 GB); it looks at its socket before each slot.
_ANSWER_S = 10.0
_REAP_S = 10.0  # a SIGKILLed spare is reaped within it (the kernel releases its GPU memory)

MakeSpare = Callable[[int, bool], Tuple[int, socket.socket]]  # (local rank, cuda) → (pid, its socket)


class SpareFailed(Exception):
    """Why a spare cannot serve (one line): spares go off, the rank starts the usual way."""


class _Interrupted(Exception):
    """A wait cut short by a signal: no verdict."""


class SpareState(str, enum.Enum):
    """A spare's life: WARMING → READY → TAKEN (that rank's worker now); WARMING or READY → GONE
    (its warm-up failed, it died or refused, or it was let go)."""

    WARMING = "warming"
    READY = "ready"
    TAKEN = "taken"
    GONE = "gone"


class Spare:
    """One parked process for ``local_rank``, and our end of its socket."""

    def __init__(self, local_rank: int, pid: int, sock: socket.socket, cuda: bool) -> None:
        self.local_rank = local_rank
        self.pid = pid
        self.cuda = cuda  # it makes a CUDA context before it is ready: seconds, not a fork's ms
        self.made: dict = {}  # its warm-up's report: device, seconds, gpu_bytes (None: unknown)
        self.state = SpareState.WARMING
        self._sock = sock
        self._process = ForkedWorker(pid)

    def wait_ready(self, timeout: float, go_on: Callable[[], bool] = lambda: True) -> None:
        if self.state is not SpareState.WARMING:
            return
        answer = self._receive(timeout, "its warm-up", go_on)
        if "ready" not in answer:
            raise SpareFailed(
                f"local rank {self.local_rank}'s spare could not warm up ({answer.get('error')})"
            )
        self.made = answer["ready"]
        self.state = SpareState.READY

    def ready_now(self) -> bool:
        """Whether it has warmed up: its answer read if it came, never waited for."""
        if self.state is SpareState.WARMING and select.select([self._sock], [], [], 0)[0]:
            self.wait_ready(_READY_S)
        return self.state is SpareState.READY

    @property
    def ready_within(self) -> float:
        """How long its warm-up may take: a CUDA context, or a fork's moment."""
        return _READY_S if self.cuda else _PARKED_ANSWER_S

    def take(self, spec: WorkerSpec, stdout_w: int, stderr_w: int, go_on: Callable[[], bool]) -> ForkedWorker:
        """Hand it ``spec``'s rank: once it answers, it is that rank's worker."""
        self.wait_ready(self.ready_within, go_on)
        request = json.dumps({"argv": list(spec.argv), "env": dict(spec.env), "cwd": os.getcwd()}).encode()
        try:
            socket.send_fds(self._sock, [request], [stdout_w, stderr_w])
        except OSError as err:
            if err.errno == errno.EMSGSIZE:
                raise SpareFailed(
                    f"the rank's command line and environment ({len(request) // 1024} KiB) are more "
                    "than one message to a spare can carry"
                ) from None
            raise SpareFailed(f"local rank {self.local_rank}'s spare died ({self._exit()})") from None
        try:
            answer = self._receive(_ANSWER_S if self.cuda else _PARKED_ANSWER_S, "its hand-over", go_on)
        except _Interrupted:  # it may be that rank's worker by now: it is no one's, let it go
            self.discard()
            raise
        if answer.get("pid") != self.pid:
            raise SpareFailed(
                f"local rank {self.local_rank}'s spare refused its rank ({answer.get('error')})"
            )
        self.state = SpareState.TAKEN
        self._sock.close()
        return self._process

    def discard(self) -> None:
        """Let it go: killed (it holds nothing to save) and reaped, unless it is a worker now."""
        self._sock.close()
        if self.state is SpareState.TAKEN:
            return
        self.state = SpareState.GONE
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_S
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)

    def _receive(self, timeout: float, what: str, go_on: Callable[[], bool] = lambda: True) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if not go_on():
                raise _Interrupted()
            if select.select([self._sock], [], [], 0.1)[0]:
                data = b""
                with contextlib.suppress(ConnectionError):  # died: as EOF
                    data = self._sock.recv(_MAX_MESSAGE)
                if data:
                    return json.loads(data)
                raise SpareFailed(f"local rank {self.local_rank}'s spare died ({self._exit()})")
            if self._process.poll() is not None:
                raise SpareFailed(f"local rank {self.local_rank}'s spare died ({self._exit()})")
            if time.monotonic() > deadline:
                raise SpareFailed(
                    f"local rank {self.local_rank}'s spare gave no answer to {what} in {timeout:g} s"
                )

    def _exit(self) -> str:
        deadline = time.monotonic() + 1.0  # its socket closes as it exits: the status follows
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        code = self._process.returncode
        return "exit status unknown yet" if code is None else f"exit {code}"


class WarmSpares:
    """A spare per local rank while on; off for good after the first trouble (said once).

    On or off, a failed group's stop has a process without CUDA forked for each local rank that has
    no spare (``missing_ahead``, then ``add_parked``): the restart takes it as it takes a spare,
    and its fork (tens of ms, with torch's address space) overlaps the old group's exit instead of
    holding up the new one's start. Not where spares make CUDA contexts: their refill makes those,
    warm."""

    def __init__(self, nproc: int, cuda: bool, say: Callable[[str], None], on: bool = True) -> None:
        self._nproc = nproc
        self._cuda = cuda  # make each spare's CUDA context on GPU <local rank> (nccl)
        self._say = say
        self._on = on
        self._ahead = not (on and cuda)  # fork_ahead: off after the first trouble, like spares
        self._spares: Dict[int, Spare] = {}  # local rank → its parked spare
        self._guard: Optional[OrphanGuard] = None
        self._cost_said = False

    @property
    def pids(self) -> Tuple[int, ...]:
        return tuple(spare.pid for spare in self._spares.values())

    def make_one(self, make: MakeSpare, guard: OrphanGuard) -> bool:
        """A spare for the first local rank that has none; ``make`` forks it (the fork server's;
        its errors are the caller's). Returns whether a rank still has none."""
        self._guard = guard
        missing = [rank for rank in range(self._nproc) if rank not in self._spares] if self._on else []
        if missing:
            pid, sock = make(missing[0], self._cuda)
            self._spares[missing[0]] = Spare(missing[0], pid, sock, self._cuda)
            guard.watch(pid)
        return len(missing) > 1

    def missing_ahead(self) -> List[int]:
        """The local ranks a failed group's stop forks a process ahead for: those without a spare
        (none once forking ahead is off)."""
        return [rank for rank in range(self._nproc) if rank not in self._spares] if self._ahead else []

    def add_parked(self, local_rank: int, pid: int, sock: socket.socket, guard: OrphanGuard) -> None:
        """A process forked ahead for ``local_rank`` (no CUDA): its spare until taken."""
        self._guard = guard
        spare = Spare(local_rank, pid, sock, cuda=False)
        if local_rank in self._spares:  # made meanwhile by a refill: one is enough
            spare.discard()
            return
        self._spares[local_rank] = spare
        guard.watch(pid)

    def say_cost_once(self, go_on: Callable[[], bool]) -> None:
        """Wait for the first spares to be ready, then say once what one costs (measured by each
        spare as it warmed up, before any worker of ours was on its GPU)."""
        if self._cost_said or not self._spares or not self._on:
            return
        try:
            for spare in self._spares.values():
                spare.wait_ready(spare.ready_within, go_on)
        except _Interrupted:
            return
        except SpareFailed as err:
            self.turn_off(str(err))
            return
        self._cost_said = True
        self._say(cost_line([spare.made for spare in self._spares.values()]))

    def take(
        self, spec: WorkerSpec, stdout_w: int, stderr_w: int, go_on: Callable[[], bool] = lambda: True
    ) -> Optional[ForkedWorker]:
        """The rank's spare, now its worker; None when there is none to take. A spare still
        making its CUDA context is not waited for (its warm-up may take longer than a worker
        forked now takes to make what it makes: 1.1 s against 0.6–0.7 s on an H100): it stays for
        the next start. One without CUDA is ready a moment after its fork: waited for, since a
        fork now would cost more and leave it parked through the attempt (found from outside: a
        many-node restart's leader met the others before its process forked ahead said ready,
        forked its ranks anew and kept the unused ones)."""
        spare = self._spares.get(spec.local_rank)
        if spare is None:
            return None
        try:
            if spare.cuda and not spare.ready_now():
                return None
            del self._spares[spec.local_rank]
            return spare.take(spec, stdout_w, stderr_w, go_on)
        except _Interrupted:
            if spare.state is SpareState.GONE:  # let go during its hand-over
                self._let_go(spare)
            else:  # a signal came while it still warmed up: it stays for the next start
                self._spares[spec.local_rank] = spare
            return None
        except SpareFailed as err:
            self._let_go(spare)
            self.turn_off(str(err))
            return None

    def turn_off(self, why: str) -> None:
        if self._on or self._ahead:
            what = "warm spare" if self._on else "forking ranks ahead"
            self._say(f"{what} off: {why}; ranks start as forks of the fork server")
        self._on = self._ahead = False
        self.close()

    def close(self) -> None:
        for spare in list(self._spares.values()):
            self._let_go(spare)
        self._spares.clear()

    def _let_go(self, spare: Spare) -> None:
        spare.discard()
        self._spares.pop(spare.local_rank, None)
        if self._guard is not None:
            self._guard.forget(spare.pid)


def cost_line(made: List[dict]) -> str:
    """What a spare costs, in one line: its GPU memory (NVML's count; 'unknown' where it could not
    be read) and the time its warm-up took."""
    if not made or all(m["device"] == "cpu" for m in made):
        return f"warm spare: {len(made)} parked worker(s), one per local rank, forked ahead (no CUDA)"
    seconds = max(m["seconds"] for m in made)
    known = [m["gpu_bytes"] for m in made if m["gpu_bytes"] is not None]
    if len(known) < len(made):
        memory = "unknown (NVML could not count it)"
    else:
        low, high = (round(size / 2**20) for size in (min(known), max(known)))
        memory = f"{low} MiB" if low == high else f"{low}–{high} MiB"
    nccl_not = sorted({m["nccl"] for m in made if m.get("nccl")})  # why NCCL was not set up ahead
    ahead = "CUDA context and cuBLAS handle" if nccl_not else "CUDA context, cuBLAS handle and NCCL's set-up"
    line = (
        f"warm spare: {len(made)} parked worker(s), one per GPU, {ahead} made ahead in {seconds:.2f} s; "
        f"GPU memory each: {memory}"
    )
    return line + (f" (NCCL not set up ahead: {nccl_not[0]})" if nccl_not else "")
