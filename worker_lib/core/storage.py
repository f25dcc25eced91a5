"""Checkpoint storage through fsspec: one URL parsed once, atomic writes, bounded retries. Nothing
branches on the scheme: a local filesystem writes a temporary name and renames, an object store
(whose PUT is whole or nothing) writes in place.
"""

import concurrent.futures
import contextlib
import logging
import mmap
import os
import posixpath
import time
import uuid
from typing import BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from worker_lib.core import checksum

__all__ = ["Storage", "StorageError"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_RETRY_DELAYS_S = (0.5, 1.0, 2.0)  # then give up: the previous committed step stays loadable
_CHUNK = 8 * 2**20
_OVERLAP_MIN = 2**20  # a write this big is checksummed on a helper thread while it is written


class StorageError(RuntimeError):
    """Checkpoint storage cannot be used; the message names the URL and the cause."""


_MOST_REMEMBERED = 1000  # distinct warnings: past them, each passes (memory stays bounded)


class _OncePerProcess(logging.Filter):
    """A warning a library repeats at every call is said the first time only; errors (and what a
    user asked for below warnings) always pass."""

    def __init__(self) -> None:
        super().__init__()
        self._said: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or len(self._said) >= _MOST_REMEMBERED:
            return True
        message = record.getMessage()
        if message in self._said:
            return False
        self._said.add(message)
        return True


# Loggers that warn at every call: gcsfs's uncached bucket-layout look-up (ZB_HNS) fails without
# the permission, or on an emulator, and says so each time.
_REPEATING = ("gcsfs",)


def _said_once(names=_REPEATING) -> None:
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OncePerProcess) for f in logger.filters):
            logger.addFilter(_OncePerProcess())


class Storage:
    """The filesystem behind ``url``; create it inside the worker (fsspec caches per pid).
    ``label`` names what it holds in error messages ("checkpoint storage", "run dir")."""

    def __init__(self, url: str, label: str = "checkpoint storage", **storage_options) -> None:
        self.url = url
        self.label = label
        self.options = dict(storage_options)  # for another fsspec user of the same storage (DCP)
        _said_once()
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as err:
            raise StorageError(f"{label} {url!r}: {err}") from None
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        """The full URL (with its protocol) of a path under the root, for another fsspec user."""
        return self.fs.unstrip_protocol(self.path(*parts))

    def check_writable(self, name: str) -> None:
        """Write and delete a probe object, so bad storage fails before training starts."""
        probe = f".ftlaunch-probe-{name}-{uuid.uuid4().hex[:8]}"
        try:
            self.write_bytes(probe, b"ok", retries=False)
            self.fs.rm_file(self.path(probe))
        except Exception as err:  # fsspec backends raise anything: report it, whatever it is
            cause = str(err) if isinstance(err, StorageError) else _describe(err)
            raise StorageError(f"{self.label} {self.url!r} is not usable: {cause}") from None

    def write_bytes(self, rel: str, data: bytes, retries: bool = True) -> None:
        self.write_stream(rel, lambda handle: handle.write(data), retries)

    def write_stream(
        self, rel: str, fill: Callable[[BinaryIO], object], retries: bool = True
    ) -> Tuple[int, str]:
        """Write what ``fill(handle)`` writes, atomically; return its size and CRC32C (computed as
        the bytes go by). ``fill`` may be called again on a retry."""
        target = self.path(rel)
        write = self._write_local if self.is_local else self._write_object
        return self._retrying(lambda: write(target, fill), f"writing {target}", retries)

    def read_bytes(self, rel: str, retries: bool = True) -> bytes:
        target = self.path(rel)
        return self._retrying(lambda: self.fs.cat_file(target), f"reading {target}", retries)

    def checksum_of(self, rel: str, algorithm: str = checksum.CRC32C) -> Tuple[int, str]:
        """The size and checksum of a file another writer made (DCP's): the store's own CRC32C
        where it keeps one (GCS), else the file read once."""
        target = self.path(rel)

        def read() -> Tuple[int, str]:
            self.fs.invalidate_cache(target)
            info = self.fs.info(target)
            stored = checksum.from_object_info(info) if algorithm == checksum.CRC32C else None
            if stored is not None:
                return int(info["size"]), stored
            if self.is_local:
                return checksum.of_file(target, algorithm)
            summer = checksum.new(algorithm)
            size = 0
            with self.fs.open(target, "rb") as handle:
                for chunk in iter(lambda: handle.read(_CHUNK), b""):
                    summer.update(chunk)
                    size += len(chunk)
            return size, summer.hexdigest()

        return self._retrying(read, f"reading {target}", True)

    @contextlib.contextmanager
    def mapped(self, rel: str) -> Iterator[Tuple[memoryview, str]]:
        """A local file mapped read-only, and a path to that same open file (for
        ``torch.load(mmap=True)``): valid until the context ends, even if the file is replaced."""
        with open(self.path(rel), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:  # mmap refuses an empty file
                yield memoryview(b""), f"/proc/self/fd/{handle.fileno()}"
                return
            with mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) as region:
                view = memoryview(region)
                try:
                    yield view, f"/proc/self/fd/{handle.fileno()}"
                finally:
                    view.release()

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def list_names(self, rel: str = "") -> List[str]:
        """Names directly under ``rel``; empty when it does not exist."""
        self.fs.invalidate_cache(self.path(rel))  # other processes write here: no stale listing
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

    def _write_local(self, target: str, fill: Callable[[BinaryIO], object]) -> Tuple[int, str]:
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as handle:
                hashing = _HashingWriter(handle)
                _fill(fill, hashing)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a half-written file must not keep a full disk full
            raise
        _fsync_dir(folder)  # the rename itself must survive a power cut
        return hashing.size, hashing.checksum.hexdigest()

    def _write_object(self, target: str, fill: Callable[[BinaryIO], object]) -> Tuple[int, str]:
        with self.fs.open(target, "wb") as handle:  # the object appears whole, on close
            hashing = _HashingWriter(handle)
            _fill(fill, hashing)
        return hashing.size, hashing.checksum.hexdigest()

    def _retrying(self, action: Callable[[], _T], what: str, retries: bool) -> _T:
        delays = _RETRY_DELAYS_S if retries else ()
        for attempt, delay in enumerate((*delays, None)):
            try:
                return action()
            except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError):
                raise  # not transient: retrying cannot help
            except Exception as err:
                if delay is None:
                    raise StorageError(f"{what}: {_describe(err)}") from err
                log.warning("%s failed (%s); retry %d in %.1fs", what, _describe(err), attempt + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


class _HashingWriter:
    """A write-only stream that checksums and counts what passes through to ``handle``."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.checksum = checksum.new()
        self.size = 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        self.size += len(data)
        # Checksummed on a helper thread while written (both release the GIL); done before return.
        summing = _beside(self.checksum.update, data) if len(data) >= _OVERLAP_MIN else None
        try:
            if summing is None:
                self.checksum.update(data)
            return self._handle.write(data)
        except OSError as err:  # torch.save hides it behind "unexpected pos": keep the real cause
            self.error = err
            raise
        finally:
            if summing is not None:
                summing.result()

    def reraise_cause(self, raised: BaseException) -> None:
        """Raise the storage error behind ``raised`` (e.g. ENOSPC), if that is what it was."""
        if self.error is not None and self.error is not raised:
            raise self.error from raised

    def flush(self) -> None:
        self._handle.flush()


_summers: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _summer() -> concurrent.futures.ThreadPoolExecutor:
    """This process's helper thread for big writes' checksums (a forked child makes its own)."""
    pid = os.getpid()
    if pid not in _summers:
        _summers.clear()
        _summers[pid] = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ftlaunch-checksum"
        )
    return _summers[pid]


def _beside(update: Callable[[bytes], object], data) -> Optional[concurrent.futures.Future]:
    """``update(data)`` on the helper thread; None once the interpreter's exit began (it refuses
    work then, which failed saves written as the script ended): the caller checksums itself."""
    try:
        return _summer().submit(update, data)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return None


def _fill(fill: Callable[[BinaryIO], object], hashing: _HashingWriter) -> None:
    try:
        fill(hashing)  # type: ignore[arg-type]  # a write-only file-like, not a BinaryIO: all fill writes to
    except Exception as err:
        hashing.reraise_cause(err)
        raise


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
