"""Directory mode: a checkpoint is whatever files the script writes into a local folder, uploaded
in the background to ``step_<n>/files/`` (one folder for every rank; a name written by two ranks
is an error) and committed. A load verifies the newest committed step's files once per node (one
rank under a file lock, into a node cache for remote storage).
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, NamedTuple, Optional, Tuple

from worker_lib.checkpoint.manager import CheckpointError, CheckpointManager
from worker_lib.checkpoint.marker import CommitMarker, read_verified, step_dir

__all__ = ["CommittedDir", "save_directory", "latest_directory", "node_cache_root"]

log = logging.getLogger(__name__)

_FILES = "files"


@contextlib.contextmanager
def save_directory(
    manager: CheckpointManager, step: int, metrics: Optional[Dict[str, float]]
) -> Iterator[str]:
    repeated = manager.repeats(step)  # the script still gets a folder; its files are dropped
    manager.wait()
    local = Path(tempfile.mkdtemp(prefix=f"ftlaunch-save-{step}-rank{manager.rank}-"))
    try:
        yield str(local)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    if repeated:
        shutil.rmtree(local, ignore_errors=True)
        return
    files = sorted(p for p in local.rglob("*") if p.is_file())
    parts = [manager.own_rng_part()]
    parts += [(f"{_FILES}/{p.relative_to(local).as_posix()}", _copier(p)) for p in files]
    cleanup = lambda: shutil.rmtree(local, ignore_errors=True)  # noqa: E731
    manager.submit(step, parts, dict(metrics or {}), kind="directory", cleanup=cleanup)


def _copier(path: Path):
    def copy(handle) -> None:
        with open(path, "rb") as source:
            shutil.copyfileobj(source, handle, 8 * 2**20)

    return copy


class CommittedDir(NamedTuple):
    """The newest committed directory-mode step: its number and a local folder with its files."""

    step: int
    path: str


def latest_directory(manager: CheckpointManager, run_id: str, attempt: int) -> Optional[CommittedDir]:
    """The newest committed step's files in a local directory, or None on a fresh run."""
    cache = node_cache_root(run_id) / f"attempt_{attempt}"
    found = manager.newest_agreed(lambda marker: _read_files(manager, cache, marker))
    if found is None:
        return None
    marker, payload = found
    manager.restore_rng(payload["own"])
    return CommittedDir(marker.step, payload["folder"])


def node_cache_root(run_id: str) -> Path:
    """This user's cache of fetched checkpoint files on this node, for one run: a private folder
    (0700) used only if this user's own, since another user could plant files in the temp dir."""
    if run_id in ("", ".", "..") or "/" in run_id:  # rank 0 removes this folder at close
        raise CheckpointError(f"the run id {run_id!r} names no folder of the node cache: give a plain name")
    base = Path(tempfile.gettempdir()) / f"ftlaunch-cache-{os.getuid()}"
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass
    found = os.lstat(base)
    if not stat.S_ISDIR(found.st_mode):
        problem = "it is not a folder (a link?)"
    elif found.st_uid != os.getuid():
        problem = f"it belongs to uid {found.st_uid}"
    elif found.st_mode & 0o022:
        problem = f"other users may write into it (mode {oct(found.st_mode & 0o777)})"
    else:
        if found.st_mode & 0o077:  # ours, and no one else could write: made private now
            os.chmod(base, 0o700)
        return base / run_id
    raise CheckpointError(
        f"refusing the node cache {base}: {problem}; remove it and ftlaunch makes a private one"
    )


def _read_files(manager, cache: Path, marker: CommitMarker) -> Tuple[Dict[str, Any], Optional[str]]:
    step = marker.step
    own, problem = manager.read_own_part(marker)
    if problem:
        return {}, problem
    # Keyed by the marker's digest: another run's cache under this run id is never taken.
    digest = hashlib.sha256(marker.to_bytes()).hexdigest()[:16]
    folder = cache / f"{step_dir(step)}-{digest}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.with_suffix(".lock")):
        status = folder.with_suffix(".status")
        if not status.exists():  # the first rank of this node to get here does the work
            status.write_text(json.dumps(_fetch_and_verify(manager, folder, marker)))
        verdict = json.loads(status.read_text())
    if verdict["problem"]:
        return {}, verdict["problem"]
    return {"own": own, "folder": verdict["folder"]}, None


def _fetch_and_verify(manager, folder: Path, marker: CommitMarker) -> Dict[str, Any]:
    step = marker.step
    names = sorted(n for n in marker.parts if n.startswith(f"{_FILES}/"))
    for name in names:
        data, problem = read_verified(manager.storage, step, name, marker.parts[name])
        if problem:
            return {"problem": problem, "folder": None}
        if not manager.storage.is_local:
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    log.info(
        "checkpoint step %d: %d files verified%s",
        step,
        len(names),
        "" if manager.storage.is_local else f" and fetched to {folder}",
    )
    source = (
        manager.storage.path(step_dir(step), _FILES) if manager.storage.is_local else str(folder / _FILES)
    )
    return {"problem": None, "folder": source}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
