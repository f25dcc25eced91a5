"""Host buffers the state is copied into, and the copies (the CUDA part, kept thin).
``HostBuffer`` is one flat mapping (anonymous, or a /dev/shm slot's file), registered with CUDA
where the state is on a GPU so the copy engine writes straight into it (pageable, with one
warning, where CUDA refuses). ``copy_in`` enqueues a CUDA tensor's copy on the current stream, so
it is the state at the call; its reader waits on the event, never the loop.
"""

import collections
import copy
import ctypes
import logging
import mmap
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from worker_lib.checkpoint.commit import CheckpointError
from worker_lib.checkpoint.flat import Layout, Split, rebuild, split

__all__ = [
    "MIN_SIZE",
    "HostBuffer",
    "Staged",
    "StagingArea",
    "copy_in",
    "host_copy",
    "host_memory_free",
    "mib",
    "read_into",
    "restore_location",
    "to_cpu",
]

log = logging.getLogger(__name__)

_warned_unpinned = False  # one warning per process when CUDA cannot register host memory
# Staged copies of CUDA tensors' storages, by address → their device: our torch.save "tagger"
# records "cuda:N" for them, so a part loads back onto a GPU as the CUDA state's own would.
_origins: Dict[int, str] = {}
_TAG_PRIORITY = 5  # asked before torch's own taggers (cpu: 10)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux, Python 3.10+
MIN_SIZE = 4096  # bytes of a buffer at least: CUDA registers no empty range, mmap maps no empty file


def mib(nbytes: int) -> str:
    """A size for a person: KiB below 1 MiB, MiB below 10 GiB, then GiB."""
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.0f} KiB"
    if nbytes < 10 * 2**30:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**30:.1f} GiB"


class HostBuffer:
    """``size`` bytes of host memory: an anonymous mapping, or ``fd``'s file shared (the file
    must already hold ``size`` bytes)."""

    def __init__(self, size: int, fd: Optional[int] = None) -> None:
        self.size = size
        self._map: Optional[mmap.mmap]  # None once closed
        if fd is None:
            self._map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:  # its pages are in memory already (tmpfs): map them all now, not one fault a page
            self._map = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | _MAP_POPULATE)
        self.pinned = False
        self._refused = False  # CUDA refused to register it: not asked again
        self._views_of: Optional[Layout] = None
        self._views: List[torch.Tensor] = []

    @property
    def refused(self) -> bool:
        return self._refused

    @property
    def address(self) -> int:
        holder = ctypes.c_char.from_buffer(self._mapping())
        try:
            return ctypes.addressof(holder)
        finally:
            del holder  # releases the export: the mapping can be closed again

    def pin(self) -> bool:
        """Register the buffer with CUDA (page-locked: the copy engine writes into it
        directly); False, with one warning per process, where CUDA refuses."""
        global _warned_unpinned
        if self.pinned or self._refused:
            return self.pinned
        code = int(torch.cuda.cudart().cudaHostRegister(self.address, self.size, 1))  # 1: portable
        self.pinned = code == 0
        self._refused = not self.pinned
        if self._refused:
            _clear_last_cuda_error()
        if self._refused and not _warned_unpinned:
            _warned_unpinned = True
            log.warning(
                "CUDA could not register %s of host memory as pinned (cudaError %d): checkpoints of "
                "CUDA state are copied synchronously into pageable memory instead (slower, same result)",
                mib(self.size),
                code,
            )
        return self.pinned

    def views(self, layout: Layout) -> List[torch.Tensor]:
        """One CPU tensor per entry of ``layout`` over this buffer (kept for the next call with
        the same layout)."""
        if layout.size > self.size:
            raise ValueError(f"a layout of {layout.size} bytes does not fit a buffer of {self.size}")
        if layout != self._views_of:
            self._views = [self._view(e.offset, e.nbytes, e.torch_dtype, e.shape) for e in layout.entries]
            self._views_of = layout
        return self._views

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        if nbytes == 0:  # frombuffer refuses an empty range; an empty tensor has no bytes to keep
            return torch.empty(shape, dtype=dtype)
        return (
            torch.frombuffer(self._mapping(), dtype=torch.uint8, count=nbytes, offset=offset)
            .view(dtype)
            .view(shape)
        )

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError("the host buffer is closed")
        return self._map

    def close(self) -> None:
        """Unregister, and let go of the mapping: unmapped once no tensor views it (``mmap.close``
        would unmap it under them)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        self._views, self._views_of = [], None
        self._map = None


def _clear_last_cuda_error() -> None:
    """Clear the "last CUDA error" a failed cudaHostRegister leaves, which torch would raise after
    its next kernel: a kernel launched here has torch's check read it (no cudaGetLastError)."""
    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:
        pass


class Staged(NamedTuple):
    """A state copied (or being copied) into host memory: ``state`` is valid once ``wait``
    returns."""

    state: Any
    events: List[Any]  # torch.cuda.Event per device copied from; empty: the copy is done

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()


def copy_in(tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> List[Any]:
    """Copy each tensor into its view: CPU tensors now, CUDA tensors enqueued on the current
    stream of their device. Returns one event per CUDA device, recorded after its copies."""
    devices: Dict[torch.device, None] = {}  # an ordered set
    for tensor, view in zip(tensors, views):
        if tensor.is_cuda:
            devices[tensor.device] = None
            view.copy_(tensor, non_blocking=True)
        else:
            host_copy(view, tensor)
    events = []
    for device in devices:
        with torch.cuda.device(device):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def to_cpu(state: Any, staging: Any = None) -> Any:
    """A copy the loop cannot change under the background writer (tensors to CPU memory,
    containers rebuilt, the rest deep-copied); ``staging``, an earlier result, lends its tensors."""
    if isinstance(state, torch.Tensor):
        if (
            isinstance(staging, torch.Tensor)
            and staging.shape == state.shape
            and staging.dtype == state.dtype
            and staging.is_contiguous()
        ):
            return staging.copy_(state.detach())
        return state.detach().to("cpu", copy=True)
    if type(state) in (dict, collections.OrderedDict):  # a state_dict is an OrderedDict
        lend = staging if isinstance(staging, dict) else {}
        return type(state)((k, to_cpu(v, lend.get(k))) for k, v in state.items())
    if type(state) in (list, tuple):
        lent = staging if type(staging) is type(state) and len(staging) == len(state) else [None] * len(state)
        return type(state)(to_cpu(v, s) for v, s in zip(state, lent))
    return copy.deepcopy(state)


def host_copy(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``target.copy_(source)`` as one memcpy where both are contiguous: torch's copy_ splits it
    over its intra-op threads, many times slower on a busy CPU."""
    if target.is_contiguous() and source.is_contiguous() and source.dtype == target.dtype and target.numel():
        ctypes.memmove(target.data_ptr(), source.data_ptr(), target.numel() * target.element_size())
        return target
    return target.copy_(source)


def read_into(handle: Any, tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """Fill the contiguous CPU ``tensor`` with the file's bytes from ``offset``: the kernel
    copies them straight in (no mapping of the file to fault in)."""
    nbytes = tensor.numel() * tensor.element_size()
    target = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    done = 0
    while done < nbytes:  # one read returns at most about 2 GiB
        got = os.preadv(handle.fileno(), [target[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{handle.name}: {nbytes - done} bytes short at offset {offset + done}")
        done += got
    return tensor


def host_memory_free() -> int:
    """Bytes of memory this host can still give without swapping (MemAvailable)."""
    import psutil

    return psutil.virtual_memory().available


class StagingArea:
    """The storage tier's staging set: one buffer, grown to the largest CUDA state staged and
    reused; ``label`` names it in the log."""

    def __init__(self, rank: int, label: str = "storage saves") -> None:
        self.rank = rank
        self.label = label
        self.buffer: Optional[HostBuffer] = None
        self._tagged: List[int] = []  # addresses this area put in ``_origins``

    def stage(self, state: Any) -> Staged:
        """Enqueue the copy of ``state`` (its other objects deep-copied now); the previous
        stage's reader must be done with the buffer (the caller waited for it)."""
        parts = split(state, copy_objects=True)
        return self.stage_split(parts)

    def stage_split(self, parts: Split) -> Staged:
        layout = parts.layout
        buffer = self._buffer_for(layout.size)
        if parts.on_cuda and not buffer.pinned and not buffer.refused:
            buffer.pin()
            self._log(buffer)
        views = buffer.views(layout)
        self._tag(views, [e.device if e.on_cuda and e.nbytes else None for e in layout.entries])
        events = copy_in(parts.tensors, views)
        return Staged(rebuild(parts.skeleton, views), events)

    def _tag(self, views: Sequence[torch.Tensor], devices: Sequence[Optional[str]]) -> None:
        _register_tagger()
        self._untag()
        for view, device in zip(views, devices):
            if device is not None:
                address = view.untyped_storage().data_ptr()
                _origins[address] = device
                self._tagged.append(address)

    def _untag(self) -> None:
        for address in self._tagged:
            _origins.pop(address, None)
        self._tagged = []

    def _buffer_for(self, size: int) -> HostBuffer:
        if self.buffer is not None and self.buffer.size >= size:
            return self.buffer
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        free = host_memory_free()
        if size > free:
            raise CheckpointError(
                f"rank {self.rank}: staging this checkpoint asks for {mib(size)} of host memory (pinned "
                f"where the state is on a GPU), and {mib(free)} is free: free host memory, or save a "
                "smaller state per rank"
            )
        self.buffer = HostBuffer(max(size, MIN_SIZE))
        return self.buffer

    def _log(self, buffer: HostBuffer) -> None:
        log.info(
            "rank %d: %s of %s host memory for %s (allocated once, reused)",
            self.rank,
            mib(buffer.size),
            "pinned" if buffer.pinned else "pageable",
            self.label,
        )

    def close(self) -> None:
        self._untag()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


def restore_location(copy_cpu: bool) -> Callable[[Any, str], Any]:
    """torch.load's ``map_location``: a CUDA storage to this rank's current device, where it has
    one; others stay on the CPU (copied when ``copy_cpu``: a mapped file may be deleted later)."""

    def where(storage: Any, location: str) -> Any:
        # Asked only for a CUDA storage: a CPU-only script on a GPU machine makes no CUDA context.
        if location.startswith("cuda") and torch.cuda.is_available():
            return storage.cuda(torch.cuda.current_device())
        return storage.clone() if copy_cpu else storage

    return where


def _origin_tag(storage: Any) -> Optional[str]:
    if not _origins or storage.device.type != "cpu":
        return None
    return _origins.get(storage.data_ptr())


def _register_tagger() -> None:
    if not any(tagger is _origin_tag for _, tagger, _ in torch.serialization._package_registry):
        torch.serialization.register_package(_TAG_PRIORITY, _origin_tag, lambda storage, location: None)
