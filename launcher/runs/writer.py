"""The run directory's reads and writes, off the supervisor's loop.

Remote storage that stops answering makes every call to it wait: gcsfs alone retries a refused
connection for about 35 s. The supervisor's loop must answer a signal or a worker's exit within
a second whatever storage does, so it never calls storage itself here: it hands each file's newest
contents to one thread (a newer write of a file replaces one not yet written), and that thread
renews the lease, confirms before every write that the run is still this supervisor's, and reads
the lock every few seconds so that silence is noticed. The loop asks ``check()`` on every turn:
it raises ``RunLost`` when another supervisor holds the run, and ``StorageLost`` when the run dir
has answered nothing (no read, no write) for longer than the lease: past it, a supervisor on
another host may take the run over, and this one could no longer tell.

A full disk is not silence: the lock still reads, so the run goes on, and each file that cannot
be written is said once (and once more when it is written again).
"""

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Set

from launcher.grammar.errors import RunLost, StorageLost
from launcher.runs.directory import RunDir

__all__ = ["RunDirWriter"]

_PROBE_S = 5.0  # the longest the thread goes without asking storage (the lease's renewal may be sooner)
_RETRY_S = 1.0  # after a call that failed
_STALL_S = 5.0  # a gap this long between two checks: this process did not run (SIGSTOP, a frozen VM)


@dataclasses.dataclass
class _Health:
    """What the thread learnt of storage, read by the loop (under the writer's lock)."""

    answered_at: float  # monotonic: the last call that storage answered
    error: str = ""  # the last call's failure, while storage does not answer
    lost: Optional[RunLost] = None


class RunDirWriter:
    """One thread that does every read and write of a held run's directory after it was opened.
    ``say`` is called from the supervisor's loop only (in ``check``)."""

    def __init__(self, directory: RunDir, lease: float, say: Callable[[str], None]) -> None:
        self._dir = directory
        self._lease = lease
        self._say = say
        self._lock = threading.Condition()
        self._pending: Dict[str, bytes] = {}  # file name → its newest contents, not yet written
        self._busy = False  # the thread is writing a batch
        self._closing = False
        self._notes: List[str] = []  # lines for the console, said by the loop
        self._unwritten: Set[str] = set()  # files whose last write failed (said once)
        now = time.monotonic()
        self._health = _Health(answered_at=now)
        self._checked_at, self._seen_answer, self._excused = now, now, 0.0
        self._thread = threading.Thread(target=self._run, name="ftlaunch-run-dir", daemon=True)
        self._thread.start()

    # -- the supervisor's loop -----------------------------------------------------------------

    def submit(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` soon; a later submit of the same name replaces it."""
        with self._lock:
            if self._health.lost is None and not self._closing:
                self._pending[name] = data
                self._lock.notify()

    def check(self) -> None:
        """Say what the thread has to say; raise RunLost or StorageLost when the run must end."""
        now = time.monotonic()
        with self._lock:
            notes, self._notes = self._notes, []
            health = dataclasses.replace(self._health)
            if health.answered_at != self._seen_answer:
                self._seen_answer, self._excused = health.answered_at, 0.0
            if now - self._checked_at > _STALL_S:  # not the storage's silence: this process's own,
                # from the last answer on (the thread may have heard from storage meanwhile: a
                # loop busy elsewhere, the thread not)
                self._excused += max(0.0, now - max(self._checked_at, health.answered_at))
            self._checked_at = now
            silence = now - health.answered_at - self._excused
        for line in notes:
            self._say(line)
        if health.lost is not None:
            raise health.lost
        if silence > self._lease:
            cause = f": {health.error}" if health.error else " (its last call has not returned)"
            raise StorageLost(
                f"run dir {self._dir.url} has not answered for {silence:.0f} s, longer than the lease "
                f"(--lease {self._lease:g} s){cause}; the workers were stopped, and the same command "
                "resumes the run once the storage answers"
            )

    def flush(self, timeout: float, watch: Callable[[], None] = lambda: None) -> bool:
        """Wait until everything submitted is written (or failed once more), at most ``timeout``
        seconds; True when nothing is left unwritten. ``watch`` is called at every look: what it
        raises (a signal: leave now) ends the wait."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.notify()
            while (self._pending or self._busy) and self._health.lost is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
                watch()
            return not self._unwritten and self._health.lost is None

    def close(self, timeout: float, watch: Callable[[], None] = lambda: None) -> None:
        """Release the lock (if it is still ours) after what is pending, and stop; a thread still
        waiting on storage after ``timeout`` seconds, or when ``watch`` raises, is left behind
        (a daemon)."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(min(deadline - time.monotonic(), 0.1))
            watch()

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._health.error

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending or self._closing, self._next_wait())
                batch, self._pending = self._pending, {}
                self._busy, closing = bool(batch), self._closing
            written = self._confirm_and_write(batch)
            with self._lock:
                self._busy = False
                for name, data in batch.items():
                    if name not in written and self._health.lost is None and not closing:
                        self._pending.setdefault(name, data)  # unless a newer one came meanwhile
                self._lock.notify_all()
                lost = self._health.lost is not None
            if lost or closing:  # closing: what is pending was tried once more
                break
            if len(written) < len(batch):
                time.sleep(_RETRY_S)
        if not lost:
            self._call(self._dir.release)

    def _next_wait(self) -> float:
        """Until the lease's renewal is due, or the next look at the lock."""
        holder = self._dir.holder
        renewal = holder.renewed_at + holder.lease / 3 - time.time() if holder else _PROBE_S
        return max(0.0, min(_PROBE_S, renewal))

    def _confirm_and_write(self, batch: Dict[str, bytes]) -> Set[str]:
        """The names written. First the lock is read: a run that is no longer ours is never
        written to again. The lease is renewed when due; that write failing (a full disk) stops
        no other."""
        if not self._call(self._dir.check_held):
            return set()
        if self._dir.renew_due(time.time()):
            self._call(self._dir.renew_unchecked, "lock.json")
        return {name for name, data in batch.items() if self._write(name, data)}

    def _write(self, name: str, data: bytes) -> bool:
        return self._call(lambda: self._dir.storage.write_bytes(name, data, retries=False), name)

    def _call(self, call: Callable[[], None], name: Optional[str] = None) -> bool:
        """One call to storage; only one that succeeds is an answer. A write that fails is said
        once per file, and once more when it works again."""
        try:
            call()
        except RunLost as lost:
            with self._lock:
                self._health.lost, self._pending = lost, {}
            return False
        except Exception as err:  # fsspec backends raise anything: the message says what
            self._failed(name, err)
            return False
        with self._lock:
            self._health.answered_at, self._health.error = time.monotonic(), ""
            if name in self._unwritten:
                self._unwritten.discard(name)
                self._notes.append(f"{self._dir.url}/{name} is written again")
        return True

    def _failed(self, name: Optional[str], err: Exception) -> None:
        text = str(err) or type(err).__name__
        with self._lock:
            self._health.error = text.splitlines()[0][:300]
            if name is not None and name not in self._unwritten:
                self._unwritten.add(name)
                self._notes.append(
                    f"cannot write {self._dir.url}/{name} ({text}); the run goes on, and tries again later"
                )
