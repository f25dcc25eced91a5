"""The supervisor's read-only look at the checkpoint dir: which step is the newest committed.

Progress is judged from what storage holds, not from what workers say, so the supervisor (before
and after each attempt), the run (on resume) and ``ftlaunch status`` all ask here.
"""

import dataclasses
from typing import List, Optional

__all__ = ["CheckpointDir", "NewestCheckpoint"]


@dataclasses.dataclass(frozen=True)
class NewestCheckpoint:
    """The newest committed step, as far as it can be known."""

    known: bool  # False: no checkpoint dir, or it could not be listed (then ``error`` says why)
    step: Optional[int] = None  # None while known: nothing committed yet
    committed_at: Optional[float] = None  # wall clock of the commit
    error: str = ""


class CheckpointDir:
    """Lists committed steps under ``url`` (None: the run has no checkpoint dir)."""

    def __init__(self, url: Optional[str]) -> None:
        self.url = url
        self._storage = None  # opened on first use: storage libraries are slow to import

    def newest(self) -> NewestCheckpoint:
        if not self.url:
            return NewestCheckpoint(known=False)
        from worker_lib.checkpoint import committed_steps
        from worker_lib.storage import Storage, StorageError

        try:
            if self._storage is None:
                self._storage = Storage(self.url)
            for step, marker in committed_steps(self._storage):
                return NewestCheckpoint(True, step, float(marker.get("time", 0.0)))
            return NewestCheckpoint(known=True)
        except (StorageError, OSError) as err:
            return NewestCheckpoint(known=False, error=str(err))

    def remove_uncommitted(self) -> List[int]:
        """Delete the step folders that hold parts but no commit marker, and return their steps.
        Only when no worker runs (the run's end): then no save is in flight, and such parts
        (a save cut off, or one whose peers failed, a full disk) can never be committed."""
        if not self.url:
            return []
        from worker_lib.checkpoint import committed_steps, step_dir, step_numbers
        from worker_lib.storage import Storage, StorageError

        try:
            if self._storage is None:
                self._storage = Storage(self.url)
            committed = {step for step, _ in committed_steps(self._storage)}
            doomed = [step for step in step_numbers(self._storage) if step not in committed]
            for step in doomed:
                self._storage.remove_tree(step_dir(step))
        except (StorageError, OSError):
            return []  # best effort: the next run's retention removes them too
        return doomed
