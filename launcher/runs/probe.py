"""Whether storage can be written now: build the filesystem of an fsspec URL, write and delete a
probe object, within a deadline, answering signals meanwhile. Preflight asks it of the run dir
and the checkpoint storage before anything starts; the health check again before a restart."""

import logging
import threading
import time
from typing import Callable, List

from launcher.grammar.errors import UsageError

__all__ = ["probe_storage", "protocol_of"]

# The most a storage library (gcsfs, s3fs) may take to import and build its filesystem before the
# probe's --storage-timeout starts: a bound, not an expectation (seconds on a busy machine).
_LIBRARY_LOAD_S = 120.0


def probe_storage(label: str, url: str, timeout: float, interrupted: Callable[[], None]) -> None:
    """Build the filesystem, then write and delete a probe object, within ``timeout`` seconds: a
    malformed URL, a missing bucket, no permission, a server that refuses, a credential look-up
    that does not end or no answer at all is one line now, not a stack of retries once per
    restart. Storage libraries retry for a minute on their own; the probe runs in a daemon
    thread, and the last error they logged while it ran is the cause given when it does not
    finish. The clock starts once the storage library is imported (seconds for gcsfs on a busy
    machine: not the storage's silence); building the filesystem (credentials) is on it."""
    from worker_lib.core.storage import Storage, StorageError

    failure: List[BaseException] = []
    loaded, built = threading.Event(), threading.Event()

    def probe() -> None:
        try:
            _import_library(url)
            loaded.set()
            storage = Storage(url, label=label)
            built.set()
            storage.check_writable("supervisor")
        except BaseException as err:  # reported by the caller's thread
            failure.append(err)

    with _LastError() as last:
        thread = threading.Thread(target=probe, name="ftlaunch-storage-probe", daemon=True)
        thread.start()
        deadline, counting = time.monotonic() + _LIBRARY_LOAD_S, False
        while thread.is_alive() and time.monotonic() < deadline:
            if not counting and loaded.is_set():
                deadline, counting = time.monotonic() + timeout, True
            interrupted()
            thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
    if thread.is_alive() and not counting:
        raise UsageError(f"{label} {url!r}: its filesystem library did not load within {_LIBRARY_LOAD_S:g} s")
    if thread.is_alive():
        cause = f"; last error: {last.message}" if last.message else ""
        if not built.is_set():
            cause = f"; it was still setting up its filesystem (credentials, a connection){cause}"
        raise UsageError(f"{label} {url!r} did not answer within {timeout:g} s (--storage-timeout){cause}")
    if failure and isinstance(failure[0], (StorageError, UsageError)):
        raise UsageError(str(failure[0])) from None
    if failure and isinstance(failure[0], Exception):  # the library's own (ConnectionRefusedError, ...)
        cause = f"{type(failure[0]).__name__}: {failure[0]}".splitlines()[0]
        raise UsageError(f"{label} {url!r} is not usable: {cause}") from None
    if failure:
        raise failure[0]


def protocol_of(url: str) -> str:
    from fsspec.core import split_protocol

    return split_protocol(url)[0] or "file"


def _import_library(url: str) -> None:
    """Import the filesystem library of each protocol of ``url`` (``simplecache::gs://…`` has two);
    one that does not exist or cannot be imported is left for ``Storage`` to report."""
    import fsspec

    for part in url.split("::"):
        try:
            fsspec.get_filesystem_class(protocol_of(part))
        except (ValueError, ImportError):
            return


class _LastError(logging.Handler):
    """Remembers the first line of the last error a library reported while installed: a warning,
    or a debug line about an exception (gcsfs says "retrying after exception: …" at debug level,
    so the root logger listens at debug meanwhile; the console's handler keeps its own level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.message = ""
        self._root_level = logging.WARNING

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip()
        about_an_error = any(word in text.lower() for word in ("exception", "error"))
        if text and (record.levelno >= logging.WARNING or about_an_error):
            self.message = text.splitlines()[0][:300]

    def __enter__(self) -> "_LastError":
        root = logging.getLogger()
        self._root_level = root.level
        root.setLevel(logging.DEBUG)
        root.addHandler(self)
        return self

    def __exit__(self, *_exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self._root_level)
