"""One memory-tier slot's files, and the thread that finishes each snapshot after its copy.

    rank_<r>.<k>          the flat buffer (``flat``), mapped shared, registered with CUDA for GPUs
    rank_<r>.<k>.index    the layout and the state's other objects (pickled), before the copy
    rank_<r>.<k>.json     the record, written last; without it the slot holds nothing

The mapping and its CUDA registration are made once per slot and process; pages are reserved
first (``posix_fallocate``), so a full /dev/shm is an error at the call, never a SIGBUS mid-copy.
"""

import dataclasses
import errno
import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from worker_lib.checkpoint import premapped
from worker_lib.checkpoint.commit import CheckpointError
from worker_lib.checkpoint.flat import Layout
from worker_lib.checkpoint.staging import HostBuffer, mib, read_into

__all__ = ["Finisher", "NoRoom", "Record", "SlotFiles"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Record:
    step: int
    kind: str  # "parts" (ft.load_checkpoint()) or "dcp" (load_checkpoint(into=...))
    world_size: int
    size: int  # bytes of the slot's data file
    index_size: int  # bytes of its index
    metrics: Dict[str, float]
    origin: str = ""  # restored from another node's copy: "node 0's copy of node 2" (the launcher's)

    @classmethod
    def from_json(cls, text: str) -> "Record":
        data = json.loads(text)
        return cls(
            int(data["step"]),
            str(data["kind"]),
            int(data["world_size"]),
            int(data["size"]),
            int(data["index_size"]),
            dict(data["metrics"]),
            str(data.get("origin", "")),
        )


class NoRoom(Exception):
    """/dev/shm cannot hold the slot: it asks ``asked`` bytes, more than the ``free`` there."""

    def __init__(self, asked: int, free: int) -> None:
        super().__init__(f"{mib(asked)} asked, {mib(free)} free")
        self.asked = asked
        self.free = free


class SlotFiles:
    """A slot's three files and this process's mapping of its data file."""

    def __init__(self, folder: Path, rank: int, slot: int) -> None:
        self.data = folder / f"rank_{rank}.{slot}"
        self.index = folder / f"rank_{rank}.{slot}.index"
        self.record = folder / f"rank_{rank}.{slot}.json"
        self._buffer: Optional[HostBuffer] = None
        self.mapped_ahead = False  # the mapping in use is the one this process's warm spare made

    def read_record(self) -> Optional[Record]:
        """The slot's record if both files are whole, else None."""
        try:
            record = Record.from_json(self.record.read_text())
            whole = self.data.stat().st_size == record.size and self.index.stat().st_size == record.index_size
        except (OSError, ValueError, KeyError, TypeError, OverflowError):  # int(Infinity): Overflow
            return None
        return record if whole else None

    def buffer_for(self, size: int) -> HostBuffer:
        """The data file, ``size`` bytes of it reserved in /dev/shm and mapped (NoRoom if they
        do not fit: then the file is gone, and the other slot untouched)."""
        if self._buffer is not None and self._buffer.size == size:
            return self._buffer
        self.release()
        self._buffer = premapped.take(self.data, size)  # this process's warm spare's, if any
        if self._buffer is not None:
            self.mapped_ahead = True
            return self._buffer
        fd = os.open(self.data, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            free = os.statvfs(fd).f_bavail * os.statvfs(fd).f_frsize
            if size - have > free:
                raise NoRoom(size, free + have)
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise NoRoom(size, free + have) from None
                raise
            self._buffer = HostBuffer(size, fd)
        except BaseException:
            os.close(fd)
            self.discard()
            raise
        os.close(fd)  # the mapping keeps the file
        return self._buffer

    def mapped(self, size: int) -> HostBuffer:
        """The whole data file of a held slot, mapped to be read (no pages reserved: they are)."""
        if self._buffer is None or self._buffer.size != size:
            self.release()
            self._buffer = premapped.take(self.data, size)
            self.mapped_ahead = self._buffer is not None
        if self._buffer is None:
            fd = os.open(self.data, os.O_RDWR)
            try:
                self._buffer = HostBuffer(size, fd)
            finally:
                os.close(fd)
        return self._buffer

    def read_tensors(self, size: int, layout: Layout, fresh: bool) -> List[torch.Tensor]:
        """The slot's tensors. ``fresh``: each its own, where it was when saved (a CUDA tensor onto
        this rank's device), every copy done on return; else views of the mapped slot."""
        if not fresh:
            return self.mapped(size).views(layout)
        device = None  # made only for a CUDA tensor: a CPU state makes no CUDA context
        if any(e.on_cuda for e in layout.entries) and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        views = self.mapped(size).views(layout) if device is not None else []
        tensors = []
        with open(self.data, "rb", buffering=0) as handle:
            for i, entry in enumerate(layout.entries):
                if device is not None and entry.on_cuda:
                    fresh_tensor = torch.empty(entry.shape, dtype=entry.torch_dtype, device=device)
                    tensors.append(fresh_tensor.copy_(views[i], non_blocking=True))
                else:
                    tensors.append(
                        read_into(handle, torch.empty(entry.shape, dtype=entry.torch_dtype), entry.offset)
                    )
        if device is not None:
            torch.cuda.current_stream(device).synchronize()
        return tensors

    def write_index(self, data: bytes) -> None:
        with open(self.index, "wb") as handle:
            handle.write(data)

    def write_record(self, record: Record) -> None:
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(record)))
        tmp.rename(self.record)

    def release(self) -> None:
        """Unmap (and unregister) the data file; the files stay."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        self.mapped_ahead = False

    def discard(self) -> None:
        """The slot holds nothing: its files go (and a mapping of them made ahead)."""
        self.release()
        premapped.forget(str(self.data))
        for path in (self.record, self.index, self.data):
            path.unlink(missing_ok=True)


class Finisher:
    """One thread that ends each snapshot after its copy (the record, the other ranks told and
    waited for), so the loop only copies; a failure is raised by the next ``wait``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.Queue[Callable[[], Any]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def submit(self, job: Callable[[], Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until every job submitted so far is done; raise the first failure."""
        if self._thread is not None:
            self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the last memory snapshot failed: {error}") from error

    def _run(self) -> None:
        _no_wakeup_preemption()
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:  # after a failure, later snapshots are not announced
                    job()
            except BaseException as err:  # raised on the loop's thread, at its next call
                log.error("memory snapshot failed: %s", err)
                self._error = err
            finally:
                self._jobs.task_done()


def _no_wakeup_preemption() -> None:
    """Make the calling thread SCHED_BATCH (Linux): the same share of the CPU, but waking it
    never preempts the thread that woke it. Measured on 2 busy cores: a plain thread woken at
    the end of each snapshot held the loop up to 40 ms (p75 13.8 ms; 1.9 ms as SCHED_BATCH)."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        return
    try:
        os.sched_setscheduler(0, batch, os.sched_param(0))  # 0: this thread
    except OSError as err:  # a policy refused (seccomp): only the loop's latency is at stake
        log.debug("the snapshot thread stays a normal thread: %s", err)
