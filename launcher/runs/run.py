"""The run directory as the supervisor uses it: resume or create the run's state, record each
attempt and the end, and keep the lease fresh. Storage and the lock live in ``runs.directory``;
the records in ``runs.records``; this module decides what goes into them and when."""

import os
import socket
import time
from typing import Callable, List, Optional, Set

from launcher.beats import BeatSummary, NodeRow, ProgressRow
from launcher.config import LaunchConfig
from launcher.events import EventLog, KeptTime
from launcher.evidence import ProgressEvidence, judge_progress
from launcher.failures import Failure, root_cause
from launcher.outcomes import AttemptOutcome, RunStatus
from launcher.runs.checkpoints import CheckpointDir, NewestCheckpoint
from launcher.runs.directory import PROGRESS_FILE, Holder, RunDir
from launcher.runs.opening import RunOpening
from launcher.runs.records import AttemptEntry, FailureCause, FailureEntry, kept_seconds
from worker_lib.storage import StorageError

__all__ = ["Run"]

_RETRY_S = 1.0
_FINISH_TRIES = 5  # the run's end: tried for a few seconds before it is left unwritten


class Run:
    """A held run: ``directory`` has been acquired (and is released by whoever acquired it);
    ``taken_from`` is the dead or expired holder it was taken over from, if any."""

    def __init__(
        self,
        config: LaunchConfig,
        directory: RunDir,
        events: EventLog,
        say: Callable[[str], None],
        taken_from: Optional[Holder] = None,
    ) -> None:
        self.config = config
        self.dir = directory
        self.checkpoints = CheckpointDir(config.group.checkpoint_url, config.world_size)
        self._events = events
        self._say = say
        self._unwritten: Set[str] = set()  # run dir files whose last write failed (said once)
        opening = RunOpening(config, directory, events, say, self.newest_checkpoint)
        # and what earlier supervisors of the run logged, kept in the run's events.jsonl
        self.state, self._earlier_events = opening.open(taken_from)

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
        self.state.status, self.state.reason, self.state.exit_code = status, reason, exit_code
        self.save(tries=_FINISH_TRIES)

    def save(self, tries: int = 1) -> None:
        """run.json and the event log, both written whole (atomically on local disks), only while
        the run is still ours: a supervisor that lost it never overwrites what the new holder wrote.
        Nothing is written before the first group runs: a launch that fails to start leaves the run
        as it was. A write that fails (a full disk) is said once and tried again at the next save
        (``tries`` times now, a second apart): the training goes on."""
        self.dir.check_held()
        self.state.updated_at = time.time()
        for left in range(tries - 1, -1, -1):
            if self._written("run.json", lambda: self.dir.write_state(self.state), quiet=left > 0):
                break
            time.sleep(_RETRY_S)
        self._written(
            "events.jsonl", lambda: self.dir.write_events(self._earlier_events + self._events.logged)
        )

    def newest_checkpoint(self) -> NewestCheckpoint:
        newest = self.checkpoints.newest()
        if newest.error:
            self._say(f"cannot list the checkpoints ({newest.error}); progress unknown")
        return newest

    def publish_progress(
        self, attempt: int, ranks: List[ProgressRow], nodes: Optional[List[NodeRow]] = None
    ) -> None:
        """The live ranks' steps and beat ages (and, with many nodes, each node's supervisor), for
        ``ftlaunch status`` on any machine."""
        self.dir.check_held()
        progress = {"attempt": attempt, "written_at": time.time(), "ranks": [r.to_json() for r in ranks]}
        if nodes is not None:
            progress["nodes"] = [n.to_json() for n in nodes]
        self._written(PROGRESS_FILE, lambda: self.dir.write_json(PROGRESS_FILE, progress))

    def keep_alive(self, now: float) -> None:
        if self.dir.renew_due(now):
            self._written("lock.json", self.dir.renew)

    def _written(self, name: str, write: Callable[[], None], quiet: bool = False) -> bool:
        """A write to the run dir that must not end the run when storage fails it: said once per
        file (and once more when it works again); False when it failed."""
        try:
            write()
        except (StorageError, OSError) as err:
            if not quiet and name not in self._unwritten:
                self._unwritten.add(name)
                self._say(
                    f"cannot write {self.dir.url}/{name} ({err}); the run goes on, and tries again later"
                )
            return False
        if name in self._unwritten:
            self._unwritten.discard(name)
            self._say(f"{self.dir.url}/{name} is written again")
        return True


def _resize(previous: Optional[AttemptEntry], nodes: List[dict]) -> str:
    """Why an attempt of many nodes runs on another number of nodes than the one before it ('':
    the same number): the nodes lost in that attempt, or the ones that did not come to the round."""
    before = [n["node"] for n in previous.nodes] if previous is not None else []
    now = [n["node"] for n in nodes]
    if not before or not now or len(before) == len(now):
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
