"""The run directory as the supervisor uses it: hold the run, resume its state, record each
attempt and the end, and keep the lease fresh. Storage mechanics live in ``run_dir``; the
records in ``run_state``; this module decides what goes into them and when."""

import os
import socket
import time
from typing import Callable, List, Optional

from launcher.config import LaunchConfig
from launcher.events import EventLog
from launcher.failures import Failure
from launcher.policy import AttemptOutcome
from launcher.run_dir import PROGRESS_FILE, Holder, RunDir
from launcher.run_state import AttemptEntry, FailureEntry, RunState, RunStatus

__all__ = ["Run"]


class Run:
    def __init__(self, config: LaunchConfig, say: Callable[[str], None]) -> None:
        self.config = config
        self.dir = RunDir(config.run_url)
        self._say = say
        self._events: Optional[EventLog] = None
        self._earlier_events: List[dict] = []
        self.state: Optional[RunState] = None
        self._checkpoints = None  # worker_lib Storage of the checkpoint dir, opened on first use
        self._taken_from: Optional[Holder] = None

    def hold(self) -> None:
        """Hold the run or raise RunBusy: before anything is written, logs included."""
        self._taken_from = self.dir.acquire(self.config.lease)

    def load(self, events: EventLog) -> None:
        """Load the run's state (resuming it) or create it."""
        self._events = events
        prior = self.dir.read_state()
        if prior is not None and self.config.fresh:
            self._archive()
            prior = None
        if prior is None:
            self.state = RunState(
                name=self.config.run_name,
                url=self.config.run_url,
                status=RunStatus.RUNNING,
                created_at=time.time(),
                config=self.config.to_json(),
            )
        else:
            self._earlier_events = self.dir.read_events()
            self.state = RunState.from_json(prior)
        if self._taken_from is not None:
            self._report_takeover(self._taken_from)
        if prior is not None:
            self._resume()

    @property
    def already_succeeded(self) -> bool:
        return self.state.status is RunStatus.SUCCEEDED

    @property
    def preemptions(self) -> int:
        return sum(a.outcome == AttemptOutcome.PREEMPTED.value for a in self.state.attempts)

    def _report_takeover(self, previous: Holder) -> None:
        now = time.time()
        how = "dead" if previous.provably_dead() else "lease expired"
        self.state.takeovers.append({"at": now, "from": previous.describe(now), "why": how})
        self._events.emit("takeover", previous=previous.describe(now), why=how)
        self._say(f"took the run over from {previous.describe(now)}: {how}")

    def _resume(self) -> None:
        state, now = self.state, time.time()
        was = state.status
        for entry in state.attempts:
            if entry.outcome is None:  # its supervisor died with it running
                entry.outcome, entry.ended_at = AttemptOutcome.SUPERVISOR_LOST.value, now
        if was is RunStatus.SUCCEEDED:
            return
        if was is RunStatus.FAILED:  # a person relaunched a run that gave up: a fresh budget
            state.budget_from = state.next_attempt
        state.status, state.reason, state.exit_code = RunStatus.RUNNING, "", None
        before = state.config.get("entrypoint")
        if before != self.config.entrypoint:
            self._say(f"the run was started with {before}; it goes on with {self.config.entrypoint}")
        state.config = self.config.to_json()
        newest = self.newest_checkpoint()  # the lost supervisor may have seen later commits
        if newest is not None and newest[0] is not None:
            state.latest_step, state.latest_step_at = newest
        step = (
            f"newest committed step {state.latest_step}"
            if state.latest_step is not None
            else "no checkpoint yet"
        )
        self._say(
            f"run {self.config.run_url}: resuming ({was.value}, {len(state.attempts)} attempt(s), {step})"
        )
        self._events.emit("resume", previous_status=was.value, attempts=len(state.attempts))
        self.save()

    def _archive(self) -> None:
        """--fresh: the old run's state, history and (default) checkpoints move aside, kept."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        fs, storage = self.dir.storage.fs, self.dir.storage
        moved = []
        fs.makedirs(storage.path("archive", stamp), exist_ok=True)
        for name in ("run.json", "events.jsonl", "checkpoints"):
            if storage.exists(name) and (name != "checkpoints" or self.config.checkpoints_in_run_dir):
                fs.mv(storage.path(name), storage.path("archive", stamp, name), recursive=True)
                moved.append(name)
        self._say(f"--fresh: the previous run's {', '.join(moved)} moved to {storage.path('archive', stamp)}")

    # -- attempts ---------------------------------------------------------------------------

    def attempt_started(self, attempt: int, newest_step: Optional[int]) -> AttemptEntry:
        entry = AttemptEntry(
            attempt, time.time(), socket.gethostname(), os.getpid(), resumed_from_step=newest_step
        )
        self.state.attempts.append(entry)
        self.save()
        return entry

    def mark_first_step(self) -> None:
        """Every rank of the current attempt has stepped: its useful work starts here."""
        self.state.attempts[-1].first_step_at = time.time()

    def attempt_ended(
        self, entry: AttemptEntry, outcome: AttemptOutcome, failures: List[Failure], newest: Optional[tuple]
    ) -> None:
        now = time.time()
        entry.ended_at, entry.outcome = now, outcome.value
        entry.failures = [FailureEntry.of(f, now) for f in failures]
        if newest is not None:
            entry.checkpoints_seen = True
            entry.newest_step_at_end, entry.newest_step_committed_at = newest
            self.state.latest_step, self.state.latest_step_at = newest
        self.save()

    def finish(self, status: RunStatus, reason: str, exit_code: int) -> None:
        self.state.status, self.state.reason, self.state.exit_code = status, reason, exit_code
        self.save()

    def save(self) -> None:
        """run.json and the event log, both written whole (atomically on local disks)."""
        self.state.updated_at = time.time()
        self.dir.write_state(self.state.to_json())
        self.dir.write_events(self._earlier_events + self._events.events)

    def newest_checkpoint(self) -> Optional[tuple]:
        """(step, commit wall time) of the newest committed checkpoint, (None, None) when there
        is none yet; None when it cannot be known (no checkpoint dir, or it cannot be read)."""
        if not self.config.checkpoint_url:
            return None
        from worker_lib.checkpoint import committed_steps
        from worker_lib.storage import Storage, StorageError

        try:
            if self._checkpoints is None:
                self._checkpoints = Storage(self.config.checkpoint_url)
            for step, marker in committed_steps(self._checkpoints):
                return step, float(marker.get("time", 0.0))
            return None, None
        except (StorageError, OSError) as err:
            self._say(f"cannot list the checkpoints ({err}); progress unknown")
        return None

    def publish_progress(self, attempt: int, ranks: List[dict]) -> None:
        """The live ranks' steps and beat ages, for ``ftlaunch status`` on any machine."""
        self.dir.write_json(PROGRESS_FILE, {"attempt": attempt, "written_at": time.time(), "ranks": ranks})

    def keep_alive(self, now: float) -> None:
        if self.dir.renew_due(now):
            self.dir.renew()

    def close(self) -> None:
        self.dir.release()
