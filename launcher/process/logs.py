"""Per-rank logs: every byte to ``rank_<r>.log``, whole lines prefixed ``[r]`` to the console.

One thread reads every worker pipe through a selector, so console lines are written by a
single writer and two ranks never mix within a line.
"""

import logging
import os
import re
import selectors
import threading
from collections import deque
from pathlib import Path
from typing import BinaryIO, Callable, Dict, List, Optional

__all__ = ["LogPump", "tail_lines"]

log = logging.getLogger(__name__)

_READ_SIZE = 65536
_CONSOLE_PIECE = 4096  # bytes of an unfinished console line kept before it goes out anyway
_PIECE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")  # text up to and with its line end or carriage return


class _Stream:
    """One worker pipe: where its bytes go, and the console line not yet finished.

    The console gets whole lines, each under its rank's prefix, so two ranks never mix within a
    line. A progress bar's carriage returns end a piece too (tqdm writes ``\r`` and no newline
    for minutes), and an unfinished piece longer than ``_CONSOLE_PIECE`` goes out as a line of its
    own: the buffer stays small and the work per byte constant. The log file gets every byte as is.
    """

    def __init__(
        self,
        fd: int,
        log_file: Optional[BinaryIO],
        console: Optional[BinaryIO],
        prefix: bytes,
        cut: Callable[[str, OSError], None] = lambda path, err: None,
    ):
        self.fd = fd
        self.log_file = log_file
        self.console = console
        self.prefix = prefix
        self.partial = bytearray()
        self._cut = cut

    def take(self, chunk: bytes) -> None:
        self._to_file(chunk)
        if self.console is None:
            return
        self.partial += chunk
        end = max(self.partial.rfind(b"\n"), self.partial.rfind(b"\r")) + 1
        pieces = _PIECE.findall(bytes(self.partial[:end]))
        del self.partial[:end]
        while len(self.partial) > _CONSOLE_PIECE:  # one read may bring 64 KiB without a line end
            pieces.append(bytes(self.partial[:_CONSOLE_PIECE]) + b"\n")
            del self.partial[:_CONSOLE_PIECE]
        out = b"".join(self.prefix + piece for piece in pieces if piece != b"\r")
        if out:
            self._to_console(out)

    def finish(self) -> None:
        """A last line without its newline still reaches the console, whole."""
        if self.console is not None and self.partial:
            self._to_console(self.prefix + bytes(self.partial) + b"\n")
        self.partial.clear()

    # A write error must not stop the pump: the worker would block on a full pipe and hang.
    def _to_file(self, data: bytes) -> None:
        log_file = self.log_file
        if log_file is None:
            return
        try:
            log_file.write(data)
            log_file.flush()
        except OSError as err:
            self._cut(log_file.name, err)
            self.log_file = None

    def _to_console(self, data: bytes) -> None:
        console = self.console
        if console is None:
            return
        try:
            console.write(data)
            console.flush()
        except OSError:  # e.g. `ftlaunch ... | head` closed the pipe: keep writing the log file
            self.console = None


class LogPump:
    """Copies worker output to log files and the console until ``close()``. A log file that
    cannot be opened or written (a full disk) is cut there, and ``cut(path, error)`` is told;
    the console and the run go on."""

    def __init__(
        self,
        console_out: BinaryIO,
        console_err: BinaryIO,
        cut: Callable[[str, OSError], None] = lambda path, err: None,
    ) -> None:
        self._console = {"stdout": console_out, "stderr": console_err}
        self._cut = cut
        self._selector = selectors.DefaultSelector()
        self._streams: Dict[int, _Stream] = {}
        self._files: List[BinaryIO] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftlaunch-logs", daemon=True)
        self._thread.start()

    def open_log(self, path: Path) -> Optional[BinaryIO]:
        """The rank's log file, None when it cannot be made (the output then goes to the console only)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "ab")
        except OSError as err:
            self._cut(str(path), err)
            return None
        self._files.append(handle)
        return handle

    def add(self, fd: int, kind: str, rank: int, log_file: Optional[BinaryIO], to_console: bool) -> None:
        """Start pumping ``fd`` (a worker's stdout or stderr pipe); ``kind`` picks the console."""
        os.set_blocking(fd, False)
        console = self._console[kind] if to_console else None
        stream = _Stream(fd, log_file, console, f"[{rank}] ".encode(), self._cut)
        with self._lock:
            self._streams[fd] = stream
            self._selector.register(fd, selectors.EVENT_READ)

    def close(self) -> None:
        """Stop the thread, copy what is still buffered in the pipes, close everything.

        Called after the workers are reaped; a grandchild that still holds a pipe open must
        not keep us waiting for an EOF, so the last read is non-blocking.
        """
        self._stopping.set()
        self._thread.join()
        for fd in list(self._streams):
            self._drain(fd)
            self._drop(fd)
        self._selector.close()
        for handle in self._files:
            try:
                handle.close()  # flushes what a failed write left in its buffer
            except OSError as err:
                self._cut(handle.name, err)

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                has_streams = bool(self._streams)
            if not has_streams:
                self._stopping.wait(0.05)
                continue
            for key, _ in self._selector.select(timeout=0.05):
                self._read_once(key.fd)

    def _read_once(self, fd: int) -> None:
        try:
            chunk = os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError as err:
            log.debug("reading worker pipe %d: %s", fd, err)
            chunk = b""
        with self._lock:
            if chunk:
                self._streams[fd].take(chunk)
            else:
                self._drop(fd)

    def _drain(self, fd: int) -> None:
        while fd in self._streams:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except OSError:  # BlockingIOError included: nothing more for now
                return
            if not chunk:
                return
            self._streams[fd].take(chunk)

    def _drop(self, fd: int) -> None:
        stream = self._streams.pop(fd, None)
        if stream is None:
            return
        stream.finish()
        self._selector.unregister(fd)
        os.close(fd)


def tail_lines(path: Path, count: int = 20, max_bytes: int = 65536) -> List[str]:
    """The last ``count`` lines of a log file, for the failure summary."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    lines = deque(data.decode("utf-8", "replace").splitlines(), maxlen=count)
    return list(lines)
