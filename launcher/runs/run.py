"""The run directory as the supervisor uses it: resume or create the run's state, record each
attempt and the end, and keep the lease fresh. Storage and the lock live in ``runs.directory``;
the records in ``runs.records``; this module decides what goes into them and when. Once the run
is open, every read and write goes through ``runs.writer``'s thread: the supervisor's loop never
waits on storage."""

import json
import math
import os
import socket
import threading
import time
from typing import Callable, Generic, List, Optional, TypeVar

from launcher.core.beats import BeatSummary, LiveProgress, NodeRow, ProgressRow
from launcher.core.events import KeptTime
from launcher.core.evidence import ProgressEvidence, judge_progress
from launcher.core.failures import Failure, root_cause
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.records import AttemptEntry, FailureCause, FailureEntry, kept_seconds
from launcher.grammar.errors import SignalReceived
from launcher.process.kit import NodeKit
from launcher.process.waiting import Wait
from launcher.runs.checkpoints import CheckpointDir, NewestCheckpoint, Uncommitted
from launcher.runs.directory import (
    EVENTS_FILE,
    PROGRESS_FILE,
    STATE_FILE,
    LockRecord,
    RunDir,
    events_bytes,
    state_bytes,
)
from launcher.runs.opening import RunOpening, RunTerms
from launcher.runs.writer import RunDirWriter

__all__ = ["Run", "StoppingTime"]

T = TypeVar("T")

_FINISH_S = 5.0  # the run's end: tried this long (a full disk may free up) before it is left unwritten
_CLOSE_S = 5.0  # then the lock's release
_LOOK_S = 0.05  # a wait on storage looks for a signal this often
_SLOW_S = 5.0  # a listing that has not answered in this long is said (a signal may end the wait)
# Once a signal came, the run's end waits on storage this long in all (the checkpoints' listing,
# the record of its end, the lock's release): with --grace-period's 5 s, within the 30 s SLURM
# (KillWait) and Kubernetes (terminationGracePeriodSeconds) give by default before SIGKILL.
_STOPPING_S = 10.0
# Once a signal cut a wait on storage short, each later one gets this long: enough for a local
# disk to take the run's end, not for storage that hangs. Within _STOPPING_S, the record and the
# release are each kept this much of it.
_HURRIED_S = 0.5


class Run:
    """A held run: ``directory`` has been acquired (and is released by whoever acquired it);
    ``taken_from`` is the dead or expired holder it was taken over from, if any."""

    def __init__(
        self,
        terms: RunTerms,
        directory: RunDir,
        kit: NodeKit,
        taken_from: Optional[LockRecord] = None,
    ) -> None:
        self.terms = terms
        self.dir = directory
        self.checkpoints = CheckpointDir(terms.checkpoint_url, terms.world_size)
        self._events, self._say, self._signals = kit.events, kit.say, kit.signals
        self._hurried = ""  # a signal that cut a wait on storage short: later ones are short
        self._stopping = StoppingTime(_STOPPING_S)  # storage's time once a signal came
        self._listing: Optional[_Listing[NewestCheckpoint]] = (
            None  # a look at the checkpoint dir still under way
        )
        opening = RunOpening(terms, directory, kit.events, kit.say, self.newest_checkpoint)
        # and what earlier supervisors of the run logged, kept in the run's events.jsonl
        self.state, self._earlier_events = opening.open(taken_from)
        self._writer = RunDirWriter(directory, terms.section.lease, kit.say)

    @property
    def already_succeeded(self) -> bool:
        return self.state.status is RunStatus.SUCCEEDED

    @property
    def preemptions(self) -> int:
        return self.state.count(AttemptOutcome.PREEMPTED)

    # -- attempts ---------------------------------------------------------------------------

    def attempt_started(
        self,
        attempt: int,
        newest_step: Optional[int],
        nodes: Optional[List[dict]] = None,
        world_size: Optional[int] = None,
    ) -> AttemptEntry:
        self._tell_kept(time.time(), in_progress=True)  # before it is one of the attempts
        entry = AttemptEntry(
            attempt,
            time.time(),
            socket.gethostname(),
            os.getpid(),
            resumed_from_step=newest_step,
            nodes=nodes or [],
            world_size=world_size,
            resize=_resize(self.state.attempts[-1] if self.state.attempts else None, nodes or []),
        )
        self.state.attempts.append(entry)  # written once its group runs (a failed start writes nothing)
        return entry

    def attempt_not_started(self, entry: AttemptEntry) -> None:
        """Its workers could not be started: it leaves no record (the error says what happened)."""
        self.state.attempts.remove(entry)

    def mark_first_step(self) -> None:
        """Every rank of the current attempt has stepped: its useful work starts here. Written at
        once (one write per attempt): if this supervisor is killed, the next one still knows that
        the script beats and when the attempt began to step."""
        entry = self.state.attempts[-1]
        entry.first_step_at, entry.beat = time.time(), True
        self.save()

    def attempt_ended(
        self,
        entry: AttemptEntry,
        outcome: AttemptOutcome,
        failures: List[Failure],
        newest: NewestCheckpoint,
        beats: BeatSummary,
        lived: float,
    ) -> None:
        now = time.time()
        entry.ended_at, entry.outcome = now, outcome
        entry.failures = [FailureEntry.of(f, now) for f in failures]
        entry.injected = bool(failures) and getattr(root_cause(failures), "injected", False)
        if newest.known:
            entry.checkpoints_seen = True
            entry.newest_step_at_end, entry.newest_step_committed_at = newest.step, newest.committed_at
            self.state.latest_step, self.state.latest_step_at = newest.step, newest.committed_at
        entry.beat, entry.furthest_step = beats.beat, beats.furthest_step
        entry.progress, entry.progress_evidence = judge_progress(self._evidence(entry, lived))
        self._tell_kept(now, in_progress=False)
        self.save()

    def _tell_kept(self, now: float, in_progress: bool) -> None:
        """Goodput's numerator so far, for the metrics (the attempts before ``now``)."""
        ended = [a for a in self.state.attempts if a.outcome is not None]
        since = self.state.attempts[0].started_at if self.state.attempts else now
        self._events.emit(KeptTime(kept_seconds(ended, now), since, in_progress))

    def _evidence(self, entry: AttemptEntry, lived: float) -> ProgressEvidence:
        earlier = [a for a in self.state.attempts if a is not entry]
        steps = [a.furthest_step for a in earlier if a.furthest_step is not None]
        return ProgressEvidence(
            commits_seen=entry.checkpoints_seen,
            committed_before=entry.resumed_from_step,
            committed_after=entry.newest_step_at_end,
            beat=entry.beat,
            furthest_step=entry.furthest_step,
            beat_before=any(a.beat for a in earlier),
            furthest_before=max(steps) if steps else None,
            lived=lived,
        )

    def finish(self, status: RunStatus, reason: str, exit_code: int) -> None:
        """Record the run's end, waiting a few seconds for storage at most (a full disk, storage
        that does not answer): the next launch of the command finds the run either way."""
        self.state.status, self.state.reason, self.state.exit_code = status, reason, exit_code
        self.save()
        limit = self._limit(_FINISH_S, kept_back=_HURRIED_S)  # for the release
        try:
            written = self._writer.flush(limit, self._cut_short())
        except SignalReceived as stop:
            self._cut(stop)
            written = False
        if not written:
            why = (
                self._hurried
                or self._writer.last_error
                or f"no answer within {limit:g} s{self._why(limit, _FINISH_S)}"
            )
            self._say(f"the run's end is not recorded in {self.dir.url}/{STATE_FILE} ({why})")

    def close(self) -> None:
        """Release the run (its lock), if storage answers within a few seconds."""
        try:
            self._writer.close(self._limit(_CLOSE_S, kept_back=0.0), self._cut_short())
        except SignalReceived as stop:
            self._cut(stop)

    # -- waits on storage ----------------------------------------------------------------------
    # Each has a deadline, and a signal that comes during one ends it (Ctrl+C again: leave now).
    # Once one did, every later wait is short: the user asked twice.

    def _limit(self, seconds: float, kept_back: float) -> float:
        """How long the next wait on storage may take: ``seconds``, less once a signal came
        (``kept_back``: what the run's end's later waits are kept of the stopping run's time)."""
        if self._hurried:
            return min(seconds, _HURRIED_S)
        if not self._signals.received:
            return seconds
        return self._stopping.limit(seconds, kept_back)

    @staticmethod
    def _why(limit: float, full: float) -> str:
        """Said after a limit shorter than its wait's own (``full``)."""
        return "" if limit >= full else ", a stopping run's limit"

    def _cut_short(self) -> Callable[[], None]:
        """What a wait on storage calls at every look: SignalReceived once a new signal came."""
        return Wait(0, self._signals).check_signals

    def _cut(self, stop: SignalReceived) -> str:
        self._hurried = f"not waited for after {stop.said_as}"
        return self._hurried

    def save(self) -> None:
        """run.json and the event log, both written whole (atomically on local disks) by the
        writer's thread, only while the run is still ours: a supervisor that lost it never
        overwrites what the new holder wrote. Nothing is written before the first group runs: a
        launch that fails to start leaves the run as it was. Raises RunLost or StorageLost when
        the run must end."""
        self._writer.check()
        self.state.updated_at = time.time()
        self._writer.submit(STATE_FILE, state_bytes(self.state))
        self._writer.submit(EVENTS_FILE, self._earlier_events.text + events_bytes(self._events.logged))

    def newest_checkpoint(self) -> NewestCheckpoint:
        """The checkpoint dir's newest step, if storage lists it within --storage-timeout. While a
        listing that did not return is still under way, the answer is unknown at once."""
        if self._listing is None or self._listing.done.is_set():
            self._listing = _Listing(self.checkpoints.newest)
        answer = self._listen(self._listing, "list the checkpoints")
        newest = answer or NewestCheckpoint(known=False, error=self._listing.error)
        if newest.error:
            self._say(f"cannot list the checkpoints ({newest.error}); progress unknown")
        return newest

    def remove_uncommitted(self) -> Uncommitted:
        """At the run's end: parts never committed go, when the checkpoint dir answers."""
        if self._listing is not None and not self._listing.done.is_set():
            return Uncommitted()  # it did not answer the last look
        removing = _Listing(self.checkpoints.remove_uncommitted)
        return self._listen(removing, "remove the parts never committed") or Uncommitted()

    def _listen(self, listing: "_Listing[T]", what: str) -> Optional[T]:
        """A look at the checkpoint dir's answer, within --storage-timeout; said once when storage
        is slow to answer, since a signal ends the wait."""
        full = self.terms.section.storage_timeout
        limit = self._limit(full, kept_back=2 * _HURRIED_S)  # for the record and the release
        named = "--storage-timeout" if limit >= full else "a stopping run's limit"
        try:
            answer = listing.result(limit, self._cut_short(), self._slow(what, limit, named), named)
        except SignalReceived as stop:
            listing.error = self._cut(stop)
            return None
        if self._hurried and not listing.done.is_set():
            listing.error = self._hurried
        return answer

    def _slow(self, what: str, limit: float, named: str) -> Callable[[], None]:
        def say() -> None:
            which = "another signal (Ctrl+C again)" if self._signals.received else "a signal"
            self._say(
                f"the checkpoint dir {self.terms.checkpoint_url} has not answered for {_SLOW_S:g} s: "
                f"waiting up to {limit:g} s ({named}) to {what}; {which} stops the wait"
            )

        return say

    def publish_progress(
        self, attempt: int, ranks: List[ProgressRow], nodes: Optional[List[NodeRow]] = None
    ) -> None:
        """The live ranks' steps and beat ages (and, with many nodes, each node's supervisor), for
        ``ftlaunch status`` on any machine."""
        self._writer.check()
        progress = LiveProgress(attempt, time.time(), ranks, nodes)
        self._writer.submit(PROGRESS_FILE, json.dumps(progress.to_json()).encode())

    def keep_alive(self, now: Optional[float] = None) -> None:
        """Called from the supervisor's loop: the writer's thread keeps the lease; this says what
        it found, and raises RunLost or StorageLost when the run must end."""
        self._writer.check()


def _nothing() -> None:
    pass


class StoppingTime:
    """Once a signal came, the run's end has ``total`` seconds on storage in all: one deadline,
    set at its first wait. Each wait keeps back what the later ones are kept, so that the last
    still ends by the deadline: a scheduler's SIGKILL comes at a fixed time, not after our waits."""

    def __init__(self, total: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._total = total
        self._clock = clock
        self._deadline: Optional[float] = None

    def limit(self, seconds: float, kept_back: float) -> float:
        """At most ``seconds``, ending ``kept_back`` before the deadline; in tenths (it is said),
        rounded down."""
        now = self._clock()
        if self._deadline is None:
            self._deadline = now + self._total
        left = math.floor((self._deadline - kept_back - now) * 10) / 10
        return max(0.0, min(seconds, left))


class _Listing(Generic[T]):
    """A look at the checkpoint dir on a thread of its own: storage that does not answer keeps
    the thread, never the supervisor's loop."""

    def __init__(self, look: Callable[[], T]) -> None:
        self.done = threading.Event()
        self._answer: Optional[T] = None
        self.error = ""
        threading.Thread(target=self._run, args=(look,), name="ftlaunch-listing", daemon=True).start()

    def _run(self, look: Callable[[], T]) -> None:
        try:
            self._answer = look()
        except Exception as err:  # a storage library's own exception: the look failed, nothing more
            self.error = f"{type(err).__name__}: {err}".splitlines()[0]
        finally:
            self.done.set()

    def result(
        self,
        timeout: float,
        watch: Callable[[], None] = _nothing,
        slow: Callable[[], None] = _nothing,
        named: str = "--storage-timeout",
    ) -> Optional[T]:
        """Its answer; None when it failed, or gave none within ``timeout`` seconds (``error``
        says which, and ``named`` what set them). ``watch`` is called at every look (what it
        raises ends the wait); ``slow`` once, when there is no answer after _SLOW_S."""
        deadline = time.monotonic() + timeout
        slow_at = time.monotonic() + _SLOW_S
        while not self.done.wait(max(0.0, min(deadline - time.monotonic(), _LOOK_S))):
            if time.monotonic() >= deadline:
                self.error = f"no answer within {timeout:g} s, {named}"
                return None
            if time.monotonic() >= slow_at:
                slow_at = float("inf")
                slow()
            watch()
        return self._answer


def _resize(previous: Optional[AttemptEntry], nodes: List[dict]) -> str:
    """Why an attempt of many nodes runs on another number of nodes than the one before it ('':
    the same number): the nodes lost in that attempt, or the ones that did not come to the round."""
    before = [n["node"] for n in previous.nodes] if previous is not None else []
    now = [n["node"] for n in nodes]
    if previous is None or not before or not now or len(before) == len(now):
        return ""
    if len(now) > len(before):
        return (
            f"grew from {len(before)} to {len(now)} nodes: node(s) {_listed(set(now) - set(before))} joined"
        )
    lost = [f.detail for f in previous.failures if f.cause is FailureCause.NODE_LOST]
    why = "; ".join(lost) if lost else f"node(s) {_listed(set(before) - set(now))} did not come to the round"
    return f"shrank from {len(before)} to {len(now)} nodes: {why}"


def _listed(nodes) -> str:
    return ", ".join(map(str, sorted(nodes)))
