"""The run directory as the supervisor uses it: resume or create the run's state, record each
attempt and the end, and keep the lease fresh. Storage and the lock live in ``runs.directory``;
the records in ``runs.records``; this module decides what goes into them and when."""

import getpass
import os
import shlex
import socket
import time
from typing import Callable, List, Optional, Set

from launcher.beats import BeatSummary, NodeRow, ProgressRow
from launcher.config import LaunchConfig
from launcher.errors import UsageError
from launcher.events import EventLog, Logged, Resume, Takeover
from launcher.evidence import ProgressEvidence, judge_progress
from launcher.failures import Failure, root_cause
from launcher.outcomes import AttemptOutcome, RunStatus
from launcher.runs.checkpoints import CheckpointDir, NewestCheckpoint
from launcher.runs.directory import PROGRESS_FILE, Holder, RunDir
from launcher.runs.records import AttemptEntry, FailureEntry, RunState
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
        self._earlier_events: List[Logged] = []  # what earlier supervisors of the run logged
        self._unwritten: Set[str] = set()  # run dir files whose last write failed (said once)
        self.state = self._load(taken_from)

    def _load(self, taken_from: Optional[Holder]) -> RunState:
        """The run's state, resumed, or created when there is none (or --fresh)."""
        if self.config.run.fresh and self.dir.has_state():
            try:
                _check_owner(self.dir.read_state(), self.config)
            except UsageError as err:
                if "not yours" in str(err):
                    raise
            self._archive()  # before reading it: --fresh is also the way out of a damaged run.json
        prior = self.dir.read_state()
        if prior is None:
            state = RunState(
                name=self.config.run.name,
                url=self.config.run.url,
                status=RunStatus.RUNNING,
                created_at=time.time(),
                config=self.config.to_json(),
                user=_user(),
            )
            named = " (named after the script and its arguments)" if self.config.has_default_name else ""
            self._say(f"run {self.config.run.url}: new{named}")
        else:
            _check_owner(prior, self.config)
            self._earlier_events = self.dir.read_events()
            state = prior
            self._compare_commands(state)
        if taken_from is not None:
            self._report_takeover(state, taken_from)
        if prior is not None:
            self._resume(state)
        return state

    @property
    def already_succeeded(self) -> bool:
        return self.state.status is RunStatus.SUCCEEDED

    @property
    def preemptions(self) -> int:
        return self.state.count(AttemptOutcome.PREEMPTED)

    def _report_takeover(self, state: RunState, previous: Holder) -> None:
        now = time.time()
        how = previous.judge(now).value
        state.takeovers.append({"at": now, "from": previous.describe(now), "why": how})
        self._events.emit(Takeover(previous=previous.describe(now), why=how))
        self._say(f"took the run over from {previous.describe(now)}: {how}")

    def _resume(self, state: RunState) -> None:
        now = time.time()
        was = state.status
        for entry in state.attempts:
            if entry.outcome is None:  # its supervisor died with it running
                entry.outcome, entry.ended_at = AttemptOutcome.SUPERVISOR_LOST, now
        if was is RunStatus.SUCCEEDED:
            return
        if was is RunStatus.FAILED:  # a person relaunched a run that gave up: a fresh budget
            state.budget_from = state.next_attempt
        state.status, state.reason, state.exit_code = RunStatus.RUNNING, "", None
        state.config = self.config.to_json()
        newest = self.newest_checkpoint()  # the lost supervisor may have seen later commits
        if newest.known:  # at this world size: the newest a rank of this job can load
            state.latest_step, state.latest_step_at = newest.step, newest.committed_at
        step = (
            f"newest committed step {state.latest_step}"
            if state.latest_step is not None
            else "no checkpoint yet"
        )
        if newest.other_size:
            steps = ", ".join(map(str, sorted(newest.other_size)))
            size = self.config.world_size
            step += f"; step(s) {steps} were saved at another size: kept, not loadable at {size} ranks"
        why = "the same command" if self.config.has_default_name else f"--run-name {self.config.run.name}"
        self._say(
            f"run {self.config.run.url}: resuming ({was.value}, {len(state.attempts)} attempt(s), {step}; "
            f"found by {why})"
        )
        self._events.emit(Resume(previous_status=was.value, attempts=len(state.attempts)))

    def _compare_commands(self, state: RunState) -> None:
        """A run resumed by another command takes on the first one's checkpoints: say so loudly."""
        recorded = state.config
        self._compare_sizes(recorded)
        before = (recorded.get("entry_kind"), recorded.get("entrypoint"), *recorded.get("script_args", ()))
        if tuple(before) == self.config.entry.command:
            return
        for line in (
            f"run {self.config.run.url} was started by another command:",
            f"  then: {_shell(before)}",
            f"  now:  {_shell(self.config.entry.command)}",
            "it goes on with the new command and the run's checkpoints and history; --fresh starts the "
            "run anew (the old one is archived), another --run-name makes a new run",
        ):
            self._say(f"WARNING: {line}")

    def _compare_sizes(self, recorded: dict) -> None:
        """Another --nproc or --nnodes: checkpoints of one rank each (not replicated) saved at the
        old size cannot be loaded at the new one. Said before anything starts."""
        now = {"nproc": self.config.group.nproc, "nnodes": self.config.cluster.nnodes}
        changed = [
            f"--{name} {recorded.get(name)} then, {value} now"
            for name, value in now.items()
            if recorded.get(name) is not None and recorded.get(name) != value
        ]
        if changed:
            self._say(
                f"WARNING: run {self.config.run.url} goes on at another size ({'; '.join(changed)}): "
                "checkpoints saved by one rank each (not replicated) load only at the size that saved them"
            )

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

    def attempt_started(
        self, attempt: int, newest_step: Optional[int], nodes: Optional[List[dict]] = None
    ) -> AttemptEntry:
        entry = AttemptEntry(
            attempt,
            time.time(),
            socket.gethostname(),
            os.getpid(),
            resumed_from_step=newest_step,
            nodes=nodes or [],
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
        self.save()

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


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): the number is still ours
        return str(os.getuid())


def _check_owner(state: Optional[RunState], config: LaunchConfig) -> None:
    """In a shared run dir, the same command of another user finds that user's run: it is not
    this user's to resume or to skip as already succeeded."""
    if state is not None and state.user is not None and state.user != _user():
        raise UsageError(
            f"run {config.run.url} was started by user {state.user}: it is not yours to resume; "
            "--run-name NAME (or another --run-dir) makes a run of your own"
        )


def _shell(command: tuple) -> str:
    """('module', 'pkg.train', '--lr', '1') → 'python -m pkg.train --lr 1'."""
    kind, entrypoint, *args = command
    runner = {"module": "python -m ", "script": "python "}.get(kind, "")
    return runner + " ".join(shlex.quote(str(part)) for part in (entrypoint, *args))
