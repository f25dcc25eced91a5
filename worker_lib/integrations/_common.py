"""What the adapters share: joining worker_lib beside a framework that owns the process group,
checking where the framework placed the ranks, committing a folder the framework wrote."""

import logging
import os
import shutil
from pathlib import Path
from typing import Any, ContextManager, Dict, Mapping, Optional, Pattern, Set

import worker_lib as ft

__all__ = [
    "BeatPause",
    "join",
    "check_placement",
    "is_own",
    "commit_folder",
    "keep_own_files",
    "finite_metrics",
]

log = logging.getLogger(__name__)


def join(checkpoint_dir: Optional[str], **options) -> None:
    """``ft.init`` unless the script called it, opening only checkpoint storage: the framework
    makes the process group."""
    if not ft.is_initialized():
        ft.init(checkpoint_dir, init_process_group=False, **options)


def check_placement(framework: str, ranks: int, device: object, fix: str) -> None:
    """The framework's count of ranks and its device against ftlaunch's (every rank calls it).
    Fewer ranks is an error (each would train alone as rank 0, their saves colliding); another
    device a warning, once per process."""
    info = ft.info()
    if ranks != info.world_size:
        raise RuntimeError(
            f"{framework} counts {ranks} rank(s) where ftlaunch started {info.world_size}, so each "
            f"would train alone: {fix}"
        )
    wanted, found = info.device.split(":")[0], str(device).split(":")[0]
    if found != wanted and framework not in _WARNED:
        _WARNED.add(framework)
        log.warning(
            "%s trains on %s, but ftlaunch chose %s for this rank (backend %s): %s",
            framework, device, info.device, info.backend, fix,
        )  # fmt: skip


_WARNED: Set[str] = set()  # the frameworks whose device check warned in this process


class BeatPause:
    """A pause of the heartbeat deadline that spans two hooks (a validation pass begins in one
    and ends in another): ``--init-timeout`` applies to it, not the step deadline."""

    def __init__(self) -> None:
        self._pause: Optional[ContextManager[None]] = None

    def begin(self) -> None:
        if self._pause is None:
            self._pause = ft.pause_heartbeat()
            self._pause.__enter__()

    def end(self) -> None:
        if self._pause is not None:
            pause, self._pause = self._pause, None
            pause.__exit__(None, None, None)


def is_own(name: str, rank: int, per_rank: Pattern) -> bool:
    """Each rank uploads its own per-rank file (``per_rank``'s group: the rank); rank 0 the shared
    ones, which the others may have written too."""
    found = per_rank.fullmatch(os.path.basename(name))
    return int(found.group(1)) == rank if found else rank == 0


def keep_own_files(folder: str, rank: int, per_rank: Pattern) -> None:
    """Remove from ``folder`` what another rank uploads."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not is_own(path.relative_to(folder).as_posix(), rank, per_rank):
            path.unlink()


def commit_folder(
    step: int, source: str, rank: int, per_rank: Pattern, metrics: Optional[Dict[str, float]] = None
) -> None:
    """Commit this rank's share of ``source`` (the framework's checkpoint) as ``step``; files are
    linked where possible (the framework writes a new folder each step)."""
    if not os.path.isdir(source):  # e.g. a hyperparameter search's trial folder: not supported
        raise FileNotFoundError(f"step {step}: the framework's checkpoint folder {source} does not exist")
    with ft.checkpoint_dir(step, metrics) as target:
        for path in sorted(Path(source).rglob("*")):
            name = path.relative_to(source).as_posix()
            if path.is_file() and is_own(name, rank, per_rank):
                destination = Path(target, name)
                destination.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, destination)
                except OSError:  # another file system (or no links): a copy
                    shutil.copyfile(path, destination)


def finite_metrics(values: Mapping[str, Any]) -> Dict[str, float]:
    """The scalar, finite values of a framework's logged metrics (tensors included)."""
    metrics = {}
    for key, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # a tensor of many values, a string
            continue
        if number == number and abs(number) != float("inf"):
            metrics[str(key)] = number
    return metrics
