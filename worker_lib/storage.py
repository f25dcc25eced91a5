"""Checkpoint storage through fsspec: one URL parsed once, atomic writes, bounded retries.

Any fsspec URL works: a path, file://, gs://, s3://, memory://. Nothing here branches on the
scheme; the one distinction is a capability: a local filesystem can fsync and rename, so its
files are written to a temporary name first. Object stores make a PUT visible whole or not
at all, so their objects are written in place.
"""

import logging
import os
import posixpath
import time
import uuid
from typing import Callable, List, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["Storage", "StorageError"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_RETRY_DELAYS_S = (0.5, 1.0, 2.0)  # then give up: the previous committed step stays loadable


class StorageError(RuntimeError):
    """Checkpoint storage cannot be used; the message names the URL and the cause."""


class Storage:
    """The filesystem behind ``url``; create it inside the worker (fsspec caches per pid)."""

    def __init__(self, url: str, **storage_options) -> None:
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as err:
            raise StorageError(f"checkpoint storage {url!r}: {err}") from None
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def check_writable(self, name: str) -> None:
        """Write and delete a probe object, so bad storage fails before training starts."""
        probe = f".ftlaunch-probe-{name}-{uuid.uuid4().hex[:8]}"
        try:
            self.write_bytes(probe, b"ok", retries=False)
            self.fs.rm_file(self.path(probe))
        except Exception as err:  # fsspec backends raise anything: report it, whatever it is
            cause = str(err) if isinstance(err, StorageError) else _describe(err)
            raise StorageError(f"checkpoint storage {self.url!r} is not usable: {cause}") from None

    def write_bytes(self, rel: str, data: bytes, retries: bool = True) -> None:
        target = self.path(rel)
        write = self._write_local if self.is_local else self._write_object
        self._retrying(lambda: write(target, data), f"writing {target}", retries)

    def read_bytes(self, rel: str) -> bytes:
        target = self.path(rel)
        return self._retrying(lambda: self.fs.cat_file(target), f"reading {target}", True)

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def list_names(self, rel: str = "") -> List[str]:
        """Names directly under ``rel``; empty when it does not exist."""
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(e.rstrip("/")) for e in entries]

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def _write_local(self, target: str, data: bytes) -> None:
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        _fsync_dir(folder)  # the rename itself must survive a power cut

    def _write_object(self, target: str, data: bytes) -> None:
        self.fs.pipe_file(target, data)

    def _retrying(self, action: Callable[[], _T], what: str, retries: bool) -> _T:
        delays = _RETRY_DELAYS_S if retries else ()
        for attempt, delay in enumerate((*delays, None)):
            try:
                return action()
            except (FileNotFoundError, PermissionError):
                raise  # not transient: retrying cannot help
            except Exception as err:
                if delay is None:
                    raise StorageError(f"{what}: {_describe(err)}") from err
                log.warning("%s failed (%s); retry %d in %.1fs", what, _describe(err), attempt + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
