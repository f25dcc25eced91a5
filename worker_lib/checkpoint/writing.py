"""Writing a step's parts and committing it on a thread of its own (or now, if blocking): one save
in flight per rank, its error raised at the next call; after a failure no further parts."""

import logging
import threading
import time
from typing import BinaryIO, Callable, Dict, List, Optional, Tuple

from worker_lib.checkpoint.commit import CheckpointError, Commits
from worker_lib.checkpoint.marker import PartEntry, step_dir
from worker_lib.core import contract as c
from worker_lib.core.chaos import act, dying_half_way
from worker_lib.core.progress import chaos_request, count_commit
from worker_lib.core.storage import Storage

__all__ = ["PartWriter"]

log = logging.getLogger(__name__)


class PartWriter:
    def __init__(self, storage: Storage, rank: int, commits: Commits) -> None:
        self.storage = storage
        self.rank = rank
        self._commits = commits
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.failed = ""  # why an earlier save failed: this rank writes no further parts

    def submit(
        self,
        step: int,
        parts: List[Tuple[str, Callable[[BinaryIO], object]]],
        metrics: Dict[str, float],
        kind: str,
        blocking: bool,
        cleanup: Callable[[], None],
        written_elsewhere: Callable[[], List[Tuple[str, PartEntry]]],
        ready: Callable[[], None],
    ) -> None:
        """Write ``parts`` (name, writer into a stream) for ``step``, commit once every rank has.
        ``cleanup`` runs after the writes; ``written_elsewhere`` lists this rank's share of the
        files another writer made (DCP's); ``ready`` waits for the state's copy first."""
        called = time.monotonic_ns()

        def job() -> None:
            try:
                ready()
                written = written_elsewhere()
                written += [self._write_part(step, name, fill) for name, fill in parts]
            finally:
                cleanup()
            self._share_and_commit(step, written, metrics, kind)
            if self.rank == 0:  # rank 0 wrote the marker: the step exists from now on
                count_commit(time.monotonic_ns() - called)

        if blocking:
            try:
                job()
            except BaseException as err:
                self.failed = f"an earlier save failed ({err})"
                raise
            return
        self._thread = threading.Thread(
            target=self._run_in_background, args=(job,), name=f"ftlaunch-save-{step}"
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight is done and retention has deleted what it let go;
        raise the save's error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._commits.settle()
        if self._error is not None:
            error, self._error = self._error, None
            self.failed = f"an earlier save failed ({error})"
            raise CheckpointError(f"the previous checkpoint save failed: {error}") from error

    def _run_in_background(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as err:  # kept for the next call on the training thread
            log.error("background checkpoint save failed: %s", err)
            self._error = err

    def _share_and_commit(
        self, step: int, written: List[Tuple[str, PartEntry]], metrics: Dict[str, float], kind: str
    ) -> None:
        action = chaos_request(c.CHAOS_AT_COMMIT)
        if action is not None:
            act(action, f"after writing its part of step {step}, before the commit")
        self._commits.commit(step, written, metrics, kind)

    def _write_part(self, step: int, name: str, fill: Callable[[BinaryIO], object]) -> Tuple[str, PartEntry]:
        action = chaos_request(c.CHAOS_AT_SAVE)
        if action is not None:
            fill = dying_half_way(fill, action)
        return name, PartEntry(*self.storage.write_stream(f"{step_dir(step)}/{name}", fill))
