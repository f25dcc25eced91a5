"""A run's home on any fsspec storage: ``run.json`` (its state), ``events.jsonl`` (its history)
and ``lock.json`` (the supervisor that holds it, and its lease).

One supervisor per run. The holder renews its lease while it lives; another ftlaunch refuses to
run while the holder may be alive, and takes the run over when the holder is provably dead (same
host, its pid gone or reused) or its lease has expired. Object stores have no atomic
create-if-absent through fsspec, so a takeover writes its lock, waits, and reads it back: of two
supervisors taking over at the same moment, the one whose lock is not there any more refuses.
"""

import dataclasses
import enum
import json
import logging
import math
import os
import time
import uuid
from typing import Any, List, Optional

import psutil

from launcher.core.beats import LiveProgress
from launcher.core.checked import fits
from launcher.core.events import Logged, parse_logged
from launcher.core.owned import pid_space
from launcher.core.records import RunState
from launcher.grammar.errors import RunBusy, RunLost, UsageError
from worker_lib.core.storage import Storage

__all__ = [
    "Damaged",
    "History",
    "LockRecord",
    "LockState",
    "RunDir",
    "STATE_FILE",
    "EVENTS_FILE",
    "LOCK_FILE",
    "PROGRESS_FILE",
    "events_bytes",
    "state_bytes",
]

STATE_FILE = "run.json"
PROGRESS_FILE = "progress.json"  # the live ranks' steps and beat ages, for `ftlaunch status`
EVENTS_FILE = "events.jsonl"
LOCK_FILE = "lock.json"
_SETTLE_S = 0.3  # between writing a lock and reading it back
_LARGEST_PID = 2**31 - 1  # pid_t

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class History:
    """events.jsonl as read: its events, and its bytes (each line ended), which a supervisor
    resuming the run writes back before its own: a line no reader takes (damage, or another
    version's event) is skipped by readers, never dropped from the file."""

    events: List[Logged]
    text: bytes


class Damaged(Exception):
    """A file of the run dir that a reader can do without is not what a supervisor writes."""


class LockState(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"  # same pid space, its pid gone or reused
    EXPIRED = "lease expired"  # another host or PID namespace, not renewed in time


@dataclasses.dataclass(frozen=True)
class LockRecord:
    """The supervisor that holds a run."""

    host: str
    pid: int
    pid_started: float  # the process's start time: tells a reused pid from the holder
    token: str
    renewed_at: float  # wall clock: hosts share no monotonic clock
    lease: float  # seconds after renewed_at until others may take over

    @classmethod
    def from_json(cls, data: Any) -> "LockRecord":
        """Raises ValueError for anything but a lock ftlaunch wrote."""
        types = {
            "host": str,
            "pid": int,
            "pid_started": float,
            "token": str,
            "renewed_at": float,
            "lease": float,
        }
        if not isinstance(data, dict) or set(data) != set(types):
            raise ValueError(f"expected the fields {sorted(types)}")
        fields = {}
        for name, kind in types.items():
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
                raise ValueError(f"{name} is {value!r}")
            if isinstance(value, (int, float)) and kind is float:
                # an int past 2**53 (10**400 does not even fit), NaN, Infinity: never ftlaunch's
                if not (isinstance(value, float) or abs(value) < 2**53) or not math.isfinite(value):
                    raise ValueError(f"{name} is {value!r}"[:80])
                value = float(value)
            fields[name] = value
        if fields["lease"] <= 0:
            raise ValueError(f"lease is {fields['lease']!r}")
        if not 0 < fields["pid"] <= _LARGEST_PID:  # psutil raises on a negative one: status exited 70
            raise ValueError(f"pid is {fields['pid']!r}"[:80])
        for name in ("pid_started", "renewed_at"):  # wall-clock times: dates, never 1e300
            if not fits(fields[name], float):
                raise ValueError(f"{name} is {fields[name]!r}"[:80])
        return cls(**fields)

    @classmethod
    def me(cls, lease: float) -> "LockRecord":
        pid = os.getpid()
        started = psutil.Process(pid).create_time()
        return cls(pid_space(), pid, started, uuid.uuid4().hex, time.time(), lease)

    def judge(self, now: float) -> "LockState":
        """In this pid space the pid tells, whatever the lease says (a supervisor stopped by
        Ctrl+Z is alive and will carry on); on another host, or in another PID namespace (where
        a live holder's pid does not exist), only the lease can."""
        if self.host == pid_space():
            return LockState.DEAD if self.provably_dead() else LockState.ALIVE
        return LockState.EXPIRED if self.expired(now) else LockState.ALIVE

    def provably_dead(self) -> bool:
        """In this pid space, with its pid gone or taken by another process."""
        if self.host != pid_space():
            return False
        try:
            return abs(psutil.Process(self.pid).create_time() - self.pid_started) > 1.0
        except psutil.NoSuchProcess:
            return True

    def expired(self, now: float) -> bool:
        return now - self.renewed_at > self.lease

    def describe(self, now: float) -> str:
        age = now - self.renewed_at
        return f"{self.host} pid {self.pid} (lease renewed {age:.0f} s ago, lasts {self.lease:g} s)"


class RunDir:
    """``retries``: whether each call is tried again (a few times, seconds apart) before it fails;
    the supervisor's writer thread retries on its own, and must hear of a failure at once."""

    def __init__(self, url: str, retries: bool = True) -> None:
        self.url = url
        self.storage = Storage(url, label="run dir")
        self._retries = retries
        self._holder: Optional[LockRecord] = None

    @property
    def holder(self) -> Optional[LockRecord]:
        """This supervisor, while it holds the run."""
        return self._holder

    # -- state and history -----------------------------------------------------------------

    def read_state(self) -> Optional[RunState]:
        """The run's state; None when there is none yet; UsageError when run.json is damaged."""
        try:
            data = json.loads(self.storage.read_bytes(STATE_FILE, self._retries))
            return RunState.from_json(data)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            what = f"{type(err).__name__}: {err}" if isinstance(err, KeyError) else str(err)
            raise UsageError(
                f"{self.url}/{STATE_FILE} is damaged ({what}); --fresh starts the run anew (the damaged "
                "file is archived), or move the file away"
            ) from None

    def has_state(self) -> bool:
        return self.storage.exists(STATE_FILE)

    def write_state(self, state: RunState) -> None:
        """Atomic: a reader sees the previous state or this one, never half."""
        self.storage.write_bytes(STATE_FILE, state_bytes(state), self._retries)

    def read_progress(self) -> Optional[LiveProgress]:
        """The live ranks, None when none were written; Damaged when progress.json is not what a
        supervisor writes (its holder rewrites it every few seconds: a reader may go on without)."""
        try:
            return LiveProgress.from_json(json.loads(self.storage.read_bytes(PROGRESS_FILE, self._retries)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError) as err:
            what = f"{type(err).__name__}: {err}" if isinstance(err, KeyError) else str(err)
            raise Damaged(f"{self.url}/{PROGRESS_FILE} is damaged ({what[:120]})") from None

    def write_json(self, name: str, data: Any) -> None:
        self.storage.write_bytes(name, json.dumps(data, default=str).encode(), self._retries)

    def read_events(self) -> List[Logged]:
        """The run's event log; lines this version cannot read are skipped, with a warning."""
        return self.read_history().events

    def read_history(self) -> "History":
        """The run's event log as read, for a supervisor that carries it on."""
        try:
            data = self.storage.read_bytes(EVENTS_FILE, self._retries)
        except FileNotFoundError:
            return History([], b"")
        events, skipped = [], 0
        for line in filter(str.strip, data.decode(errors="replace").splitlines()):
            try:
                logged = parse_logged(json.loads(line))
            except ValueError:
                logged = None
            if logged is None:
                skipped += 1
            else:
                events.append(logged)
        if skipped:
            log.warning("%s/%s: skipped %d line(s) that are not events", self.url, EVENTS_FILE, skipped)
        return History(events, data if data.endswith(b"\n") or not data else data + b"\n")

    def write_events(self, events: List[Logged]) -> None:
        self.storage.write_bytes(EVENTS_FILE, events_bytes(events), self._retries)

    # -- the lock --------------------------------------------------------------------------

    def acquire(self, lease: float) -> Optional[LockRecord]:
        """Hold the run, or raise RunBusy naming its holder. Returns the dead or expired holder
        taken over from, if any."""
        now = time.time()
        previous = self.read_lock()
        if previous is not None and previous.judge(now) is LockState.ALIVE:
            raise RunBusy(f"run {self.url} is held by another ftlaunch: {previous.describe(now)}")
        me = LockRecord.me(lease)
        self._write_lock(me)
        time.sleep(_SETTLE_S)
        if (self.read_lock() or me).token != me.token:
            raise RunBusy(f"run {self.url} was taken by another ftlaunch starting at the same moment")
        self._holder = me
        return previous

    def renew(self) -> None:
        if self._holder is not None:
            self.check_held()
            self.renew_unchecked()

    def renew_unchecked(self) -> None:
        """Renew the lease; the caller has just checked that the run is still ours."""
        if self._holder is not None:
            self._holder = dataclasses.replace(self._holder, renewed_at=time.time())
            self._write_lock(self._holder)

    def check_held(self) -> None:
        """Raise RunLost when the lock is no longer ours (another host took the run over after
        our lease expired): from then on this supervisor must not write to the run."""
        if self._holder is None:
            return
        try:
            current = self.read_lock()
        except UsageError as damaged:
            raise RunLost(
                f"run {self.url}: {damaged}; this supervisor stops its workers and leaves"
            ) from None
        if current is None or current.token != self._holder.token:
            now = time.time()
            who = current.describe(now) if current is not None else "nobody (the lock was removed)"
            raise RunLost(
                f"run {self.url} is now held by {who}: this supervisor lost it (its lease expired) "
                "and stops its workers; it writes nothing more to the run"
            )

    def renew_due(self, now: float) -> bool:
        return self._holder is not None and now - self._holder.renewed_at > self._holder.lease / 3

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self._holder is None:
            return
        current = self.read_lock()
        if current is not None and current.token == self._holder.token:
            self.storage.fs.rm_file(self.storage.path(LOCK_FILE))
        self._holder = None

    def read_lock(self) -> Optional[LockRecord]:
        """The holder, None when there is none; UsageError when lock.json is damaged (writes are
        atomic, so damage is someone else's doing: guessing who holds the run would be worse)."""
        try:
            return LockRecord.from_json(json.loads(self.storage.read_bytes(LOCK_FILE, self._retries)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as err:
            raise UsageError(
                f"{self.url}/{LOCK_FILE} is damaged ({err}); if no ftlaunch runs this run, remove that file"
            ) from None

    def _write_lock(self, holder: LockRecord) -> None:
        self.storage.write_bytes(LOCK_FILE, json.dumps(dataclasses.asdict(holder)).encode(), self._retries)


def state_bytes(state: RunState) -> bytes:
    """run.json's contents."""
    return json.dumps(state.to_json(), indent=1).encode()


def events_bytes(events: List[Logged]) -> bytes:
    """events.jsonl's contents: one event a line."""
    return "".join(json.dumps(e.to_json(), default=str) + "\n" for e in events).encode()
