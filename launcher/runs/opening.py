"""Opening a held run: create its state, or resume it (a takeover, another command or size, an
archive with --fresh, a run of another user refused). ``runs.run`` records what follows."""

import dataclasses
import getpass
import os
import shlex
import time
from typing import Any, Callable, Mapping, Optional, Tuple

from launcher.core.config import RunSection
from launcher.core.events import EventLog, Resume, Takeover
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.records import RunState
from launcher.grammar.errors import UsageError
from launcher.runs.checkpoints import NewestCheckpoint
from launcher.runs.directory import History, LockRecord, RunDir

__all__ = ["RunOpening", "RunTerms"]


@dataclasses.dataclass(frozen=True)
class RunTerms:
    """What a launch asks of its run: the run section, the command and size it runs, where its
    checkpoints go, and the configuration run.json records of it."""

    section: RunSection
    command: Tuple[str, ...]
    nproc: int
    nnodes: int
    checkpoint_url: Optional[str]
    named_by_default: bool  # the run is named after the script and its arguments
    recorded: Mapping[str, Any]  # run.json's "config" record (LaunchConfig.to_json)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def checkpoints_in_run_dir(self) -> bool:
        return self.checkpoint_url == f"{self.section.url}/checkpoints"


class RunOpening:
    """Once per supervisor, when it has acquired the run directory."""

    def __init__(
        self,
        terms: RunTerms,
        directory: RunDir,
        events: EventLog,
        say: Callable[[str], None],
        newest_checkpoint: Callable[[], NewestCheckpoint],
    ) -> None:
        self.terms = terms
        self.dir = directory
        self._events = events
        self._say = say
        self._newest_checkpoint = newest_checkpoint

    def open(self, taken_from: Optional[LockRecord]) -> Tuple[RunState, History]:
        """The run's state, resumed, or created when there is none (or --fresh), and what
        earlier supervisors of the run logged."""
        run = self.terms.section
        if run.fresh and self.dir.has_state():
            try:
                _check_owner(self.dir.read_state(), run.url)
            except UsageError as err:
                if "not yours" in str(err):
                    raise
            self._archive()  # before reading it: --fresh is also the way out of a damaged run.json
        prior = self.dir.read_state()
        earlier = History([], b"")
        if prior is None:
            state = RunState(
                name=run.name,
                url=run.url,
                status=RunStatus.RUNNING,
                created_at=time.time(),
                config=dict(self.terms.recorded),
                user=_user(),
            )
        else:
            _check_owner(prior, run.url)
            earlier = self.dir.read_history()
            state = prior
            newest = self._newest_checkpoint()  # the lost supervisor may have seen later commits
            self._compare_commands(state, newest)
        if taken_from is not None:  # said first: a run new to us may have had a supervisor that died early
            self._report_takeover(state, taken_from)
        if prior is not None:
            self._resume(state, newest)
        else:
            named = " (named after the script and its arguments)" if self.terms.named_by_default else ""
            before = "; its earlier supervisor recorded nothing of it" if taken_from is not None else ""
            self._say(f"run {run.url}: new{named}{before}")
        return state, earlier

    def _report_takeover(self, state: RunState, previous: LockRecord) -> None:
        now = time.time()
        how = previous.judge(now).value
        state.takeovers.append({"at": now, "from": previous.describe(now), "why": how})
        self._events.emit(Takeover(previous=previous.describe(now), why=how))
        self._say(f"took the run over from {previous.describe(now)}: {how}")

    def _resume(self, state: RunState, newest: NewestCheckpoint) -> None:
        now = time.time()
        was = state.status
        for entry in state.attempts:
            if entry.outcome is None:  # its supervisor died with it running
                entry.outcome, entry.ended_at = AttemptOutcome.SUPERVISOR_LOST, now
        if was is RunStatus.SUCCEEDED:
            return
        run = self.terms.section
        state.url = run.url  # where it is now: a run dir can be copied elsewhere
        if was is RunStatus.FAILED:  # a person relaunched a run that gave up: a fresh budget
            state.budget_from = state.next_attempt
        state.status, state.reason, state.exit_code = RunStatus.RUNNING, "", None
        state.config = dict(self.terms.recorded)
        if newest.known:  # at this world size: the newest a rank of this job can load
            state.latest_step, state.latest_step_at = newest.step, newest.committed_at
        step = (
            f"newest committed step {state.latest_step}"
            if state.latest_step is not None
            else "no checkpoint yet"
        )
        if newest.other_size:
            steps = ", ".join(map(str, sorted(newest.other_size)))
            size = self.terms.world_size
            step += f"; step(s) {steps} were saved at another size: kept, not loadable at {size} ranks"
        why = "the same command" if self.terms.named_by_default else f"--run-name {run.name}"
        self._say(
            f"run {run.url}: resuming ({was.value}, {len(state.attempts)} attempt(s), {step}; found by {why})"
        )
        self._events.emit(Resume(previous_status=was.value, attempts=len(state.attempts)))

    def _compare_commands(self, state: RunState, newest: NewestCheckpoint) -> None:
        """A run resumed by another command takes on the first one's checkpoints: say so loudly."""
        recorded = state.config
        self._compare_sizes(recorded, newest)
        before = (recorded.get("entry_kind"), recorded.get("entrypoint"), *recorded.get("script_args", ()))
        if tuple(before) == self.terms.command:
            return
        for line in (
            f"run {self.terms.section.url} was started by another command:",
            f"  then: {_shell(before)}",
            f"  now:  {_shell(self.terms.command)}",
            "it goes on with the new command and the run's checkpoints and history; --fresh starts the "
            "run anew (the old one is archived), another --run-name makes a new run",
        ):
            self._say(f"WARNING: {line}")

    def _compare_sizes(self, recorded: dict, newest: NewestCheckpoint) -> None:
        """Another --nproc or --nnodes, said before anything starts; loudly when committed steps
        of one rank each (per-rank parts) cannot be loaded at the new size. Replicated and DCP
        steps load at any size: a warning about them would be false."""
        now = {"nproc": self.terms.nproc, "nnodes": self.terms.nnodes}
        changed = [
            f"--{name} {recorded.get(name)} then, {value} now"
            for name, value in now.items()
            if recorded.get(name) is not None and recorded.get(name) != value
        ]
        if not changed:
            return
        line = f"run {self.terms.section.url} goes on at another size ({'; '.join(changed)})"
        if newest.other_size:
            steps = ", ".join(map(str, sorted(newest.other_size)))
            line = (
                f"WARNING: {line}: step(s) {steps} were saved by one rank each (per-rank parts), which "
                "load only at the size that saved them"
            )
        self._say(line)

    def _archive(self) -> None:
        """--fresh: the old run's state, history and (default) checkpoints move aside, kept."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        fs, storage = self.dir.storage.fs, self.dir.storage
        moved = []
        fs.makedirs(storage.path("archive", stamp), exist_ok=True)
        for name in ("run.json", "events.jsonl", "checkpoints"):
            if storage.exists(name) and (name != "checkpoints" or self.terms.checkpoints_in_run_dir):
                fs.mv(storage.path(name), storage.path("archive", stamp, name), recursive=True)
                moved.append(name)
        self._say(f"--fresh: the previous run's {', '.join(moved)} moved to {storage.path('archive', stamp)}")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): the number is still ours
        return str(os.getuid())


def _check_owner(state: Optional[RunState], url: str) -> None:
    """In a shared run dir, the same command of another user finds that user's run: it is not
    this user's to resume or to skip as already succeeded."""
    if state is not None and state.user is not None and state.user != _user():
        raise UsageError(
            f"run {url} was started by user {state.user}: it is not yours to resume; "
            "--run-name NAME (or another --run-dir) makes a run of your own"
        )


def _shell(command: tuple) -> str:
    """('module', 'pkg.train', '--lr', '1') → 'python -m pkg.train --lr 1'."""
    kind, entrypoint, *args = command
    runner = {"module": "python -m ", "script": "python "}.get(kind, "")
    return runner + " ".join(shlex.quote(str(part)) for part in (entrypoint, *args))
