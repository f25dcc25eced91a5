"""The run directory as the supervisor uses it: resume or create the run's state, record each
attempt and the end, and keep the lease fresh. Storage and the lock live in ``runs.directory``;
the records in ``runs.records``; this module decides what goes into them and when. Once the run
is open, every read and write goes through ``runs.writer``'s thread: the supervisor's loop never
waits on storage; the run's own waits on storage are ``runs.storage_time``'s."""

import json
import os
import socket
import time
from typing import List, Optional

from launcher.core.beats import BeatSummary, LiveProgress, NodeRow, ProgressRow
from launcher.core.events import KeptTime
from launcher.core.evidence import ProgressEvidence, judge_progress
from launcher.core.failures import Failure, root_cause
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.records import AttemptEntry, FailureCause, FailureEntry, kept_seconds
from launcher.grammar.errors import SignalReceived
from launcher.process.kit import NodeKit
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
from launcher.runs.storage_time import HURRIED_S, CheckpointLooks, StorageTime
from launcher.runs.writer import RunDirWriter

__all__ = ["Run"]

_FINISH_S = 5.0  # the run's end: tried this long (a full disk may free up) before it is left unwritten
_CLOSE_S = 5.0  # then the lock's release


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
        self._events, self._say = kit.events, kit.say
        self._time = StorageTime(kit.signals)
        checkpoints = CheckpointDir(terms.checkpoint_url, terms.world_size)
        self._looks = CheckpointLooks(checkpoints, terms.section.storage_timeout, self._time, kit.say)
        opening = RunOpening(terms, directory, kit.events, kit.say, self.newest_checkpoint)
        # and what earlier supervisors of the run logged, kept in the run's events.jsonl
        self.state, self._earlier_events = opening.open(taken_from)
        self._writer = RunDirWriter(directory, terms.section.lease, kit.say)

    @property
    def checkpoints(self) -> CheckpointDir:
        return self._looks.checkpoints

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
        limit = self._time.limit(_FINISH_S, kept_back=HURRIED_S)  # for the release
        try:
            written = self._writer.flush(limit, self._time.cut_short())
        except SignalReceived as stop:
            self._time.cut(stop)
            written = False
        if not written:
            why = (
                self._time.hurried
                or self._writer.last_error
                or f"no answer within {limit:g} s{self._time.why(limit, _FINISH_S)}"
            )
            self._say(f"the run's end is not recorded in {self.dir.url}/{STATE_FILE} ({why})")

    def close(self) -> None:
        """Release the run (its lock), if storage answers within a few seconds."""
        try:
            self._writer.close(self._time.limit(_CLOSE_S, kept_back=0.0), self._time.cut_short())
        except SignalReceived as stop:
            self._time.cut(stop)

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
        """The checkpoint dir's newest step, if storage lists it within --storage-timeout."""
        return self._looks.newest()

    def remove_uncommitted(self) -> Uncommitted:
        """At the run's end: parts never committed go, when the checkpoint dir answers."""
        return self._looks.remove_uncommitted()

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


def _resize(previous: Optional[AttemptEntry], nodes: List[dict]) -> str:
    """Why an attempt of many nodes runs on another number of nodes than the one before it ('':
    the same number): the nodes lost in that attempt, or the ones that did not come to the round."""
    before = [n["node"] for n in previous.nodes if not n.get("standby")] if previous is not None else []
    now = [n["node"] for n in nodes if not n.get("standby")]
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
