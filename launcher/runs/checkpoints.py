"""The supervisor's read-only look at the checkpoint dir: which step is the newest committed.

Progress is judged from what storage holds, not from what workers say, so the supervisor (before
and after each attempt), the run (on resume) and ``ftlaunch status`` all ask here.
"""

import dataclasses
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:
    from worker_lib.core.storage import Storage

__all__ = ["CheckpointDir", "NewestCheckpoint", "Uncommitted"]


@dataclasses.dataclass(frozen=True)
class NewestCheckpoint:
    """The newest committed step, as far as it can be known."""

    known: bool  # False: no checkpoint dir, or it could not be listed (then ``error`` says why)
    step: Optional[int] = None  # None while known: nothing committed yet
    committed_at: Optional[float] = None  # wall clock of the commit
    error: str = ""
    other_size: Tuple[int, ...] = ()  # newer committed steps that this world size cannot load


@dataclasses.dataclass(frozen=True)
class Uncommitted:
    """Steps whose parts never got their commit marker (removed at the run's end)."""

    steps: List[int] = dataclasses.field(default_factory=list)
    newest_committed: Optional[int] = None  # at any world size; None: nothing committed

    @property
    def newest_lost(self) -> bool:
        """A save newer than every committed step never committed: the run's last work since
        that step has no checkpoint."""
        return bool(self.steps) and (self.newest_committed is None or max(self.steps) > self.newest_committed)


class CheckpointDir:
    """Lists committed steps under ``url`` (None: the run has no checkpoint dir) that a job of
    ``world_size`` ranks can load: a step saved by one rank each at another size is not the
    run's newest for this job (its ranks cannot resume from it), though it stays in storage."""

    def __init__(self, url: Optional[str], world_size: int) -> None:
        self.url = url
        self.world_size = world_size
        self._storage: Optional[Storage] = None  # opened on first use: storage libraries import slowly

    def newest(self) -> NewestCheckpoint:
        if not self.url:
            return NewestCheckpoint(known=False)
        from worker_lib.checkpoint.marker import committed_steps
        from worker_lib.core.storage import Storage, StorageError

        try:
            storage = self._storage = self._storage or Storage(self.url)
            other_size: List[int] = []
            for marker in committed_steps(storage):
                if marker.loads_at(self.world_size):
                    return NewestCheckpoint(True, marker.step, marker.time, other_size=tuple(other_size))
                other_size.append(marker.step)
            return NewestCheckpoint(known=True, other_size=tuple(other_size))
        except (StorageError, OSError) as err:
            return NewestCheckpoint(known=False, error=str(err))

    def remove_uncommitted(self) -> Uncommitted:
        """Delete the step folders that hold parts but no commit marker, and say which (one with
        a damaged marker is kept, and said: its parts were committed once). Only when
        no worker runs (the run's end): then no save is in flight, and such parts (a save cut
        off, or one whose peers failed, a full disk) can never be committed."""
        if not self.url:
            return Uncommitted()
        from worker_lib.checkpoint.marker import step_dir, step_markers, step_numbers
        from worker_lib.core.storage import Storage, StorageError

        try:
            storage = self._storage = self._storage or Storage(self.url)
            found = list(step_markers(storage))
            committed = {step for step, marker in found if marker is not None}
            marked = {step for step, _ in found}  # a damaged marker's step is kept: it was committed
            doomed = [step for step in step_numbers(storage) if step not in marked]
            for step in doomed:
                storage.remove_tree(step_dir(step))
        except (StorageError, OSError):
            return Uncommitted()  # best effort: the next run's retention removes them too
        return Uncommitted(doomed, max(committed, default=None))
