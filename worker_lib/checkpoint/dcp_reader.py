"""DCP's reader for a local folder, viewing each tensor in a read-only mapping of its file, so that
only the copy into the state remains (DCP's own reader copies twice: docs/benchmarks.md). Any
record but a plain dense uncompressed tensor falls back to ``torch.load`` of that item; the bytes
were checked against the marker first.
"""

import dataclasses
import functools
import io
import logging
import mmap
import pathlib
import pickle
import struct
import sys
import warnings
import zipfile
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["MappedReader", "tensor_in"]

log = logging.getLogger(__name__)

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature ... name and extra lengths


class MappedReader(FileSystemReader):
    """``FileSystemReader`` with ``read_data`` reading through a mapping of each file."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if any(
            getattr(self.storage_data[r.storage_index], "transform_descriptors", None) for r in plan.items
        ):
            return super().read_data(plan, planner)
        per_file: Dict[str, List[ReadItem]] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        for relative_path, requests in per_file.items():
            try:
                # FileSystemReader made self.path a Path (its annotation says str | PathLike).
                with open(pathlib.Path(self.path) / relative_path, "rb") as handle:
                    region = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
            except (OSError, ValueError) as err:  # a file system that maps no files: DCP's own reads
                log.debug("%s cannot be mapped (%s): read as DCP reads it", relative_path, err)
                super().read_data(dataclasses.replace(plan, items=requests), planner).wait()
                continue
            self._read_mapped(region, requests, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_mapped(self, region: mmap.mmap, requests: List[ReadItem], planner: LoadPlanner) -> None:
        try:
            for request in sorted(requests, key=lambda r: self.storage_data[r.storage_index].offset):
                info = self.storage_data[request.storage_index]
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(region[info.offset : info.offset + info.length]))
                else:
                    _copy_tensor(region, info.offset, info.length, request, planner)
        finally:
            try:
                region.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass


def _copy_tensor(
    region: mmap.mmap, offset: int, length: int, request: ReadItem, planner: LoadPlanner
) -> None:
    saved = tensor_in(region, offset, length)
    if saved is None:
        saved = torch.load(
            io.BytesIO(region[offset : offset + length]), map_location="cpu", weights_only=True
        )
    for dim, (start, size) in enumerate(zip(request.storage_offsets, request.lengths)):
        saved = saved.narrow(dim, start, size)
    target = planner.resolve_tensor(request).detach()
    if target.size() != saved.size():
        raise ValueError(
            f"{request.storage_index}: the saved chunk is {tuple(saved.size())}, "
            f"the state's {tuple(target.size())}"
        )
    target.copy_(saved)
    planner.commit_tensor(request, target)


def tensor_in(region: Any, offset: int, length: int) -> Optional[torch.Tensor]:
    """The tensor ``torch.save`` wrote at ``region[offset:offset + length]``, a view; None for
    anything but one plain dense tensor, uncompressed, in this machine's byte order."""
    try:
        return _tensor_in(region, offset, length)
    except Exception:  # noqa: BLE001 - whatever this reader does not understand, torch.load reads
        return None


def _tensor_in(region: Any, offset: int, length: int) -> Optional[torch.Tensor]:
    archive = zipfile.ZipFile(_Window(region, offset, length))
    entries = {entry.filename: entry for entry in archive.infolist()}
    pickled = next((name for name in entries if name.endswith("/data.pkl")), None)
    if pickled is None or sys.byteorder != "little":
        return None
    prefix = pickled[: -len("data.pkl")]
    if prefix + "byteorder" in entries and archive.read(prefix + "byteorder") != b"little":
        return None

    def storage(key: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of record ``data/<key>``, as a uint8 tensor over the region."""
        entry = entries.get(f"{prefix}data/{key}")
        if entry is None or entry.compress_type != zipfile.ZIP_STORED:
            raise _Declined(f"record data/{key}")
        header = offset + entry.header_offset
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(
            region[header : header + _LOCAL_HEADER.size]
        )
        if signature != b"PK\x03\x04" or nbytes > entry.file_size:
            raise _Declined(f"record data/{key}")
        start = header + _LOCAL_HEADER.size + name_length + extra_length
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # Only read from (the state gets a copy): torch's non-writable warning does not apply.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start)

    found = _PlainTensorUnpickler(io.BytesIO(archive.read(pickled)), storage).load()
    return found if isinstance(found, torch.Tensor) else None


@functools.cache
def _dtype_named(module: str, name: str) -> Optional[torch.dtype]:
    """The dtype a pickle's global ``module.name`` means (a storage class or a dtype); None for
    any other name."""
    if name == "UntypedStorage" and module in ("torch", "torch.storage"):
        return torch.uint8
    if module != "torch":
        return None
    with warnings.catch_warnings():  # the typed storage classes are deprecated, not their names
        warnings.simplefilter("ignore", UserWarning)
        found = getattr(torch, name, None)
        dtype = getattr(found, "dtype", None) if name.endswith("Storage") else found
    return dtype if isinstance(dtype, torch.dtype) else None


class _Declined(pickle.UnpicklingError):
    """The record holds something this reader leaves to torch.load."""


class _Storage(NamedTuple):
    """A persistent id resolved: a dtype and the record's bytes."""

    dtype: torch.dtype
    data: torch.Tensor


def _rebuild_v2(storage: _Storage, offset: int, size, stride, requires_grad=False, hooks=None, metadata=None):
    """``torch._utils._rebuild_tensor_v2``: a tensor of its storage's dtype."""
    return _view(storage, storage.dtype, offset, size, stride, hooks, metadata)


def _rebuild_v3(storage: _Storage, offset: int, size, stride, requires_grad, hooks, dtype, metadata=None):
    """``torch._utils._rebuild_tensor_v3``: a dtype without a storage class of its own (float8)
    over untyped bytes."""
    return _view(storage, dtype, offset, size, stride, hooks, metadata)


def _view(storage: _Storage, dtype: Any, offset: int, size, stride, hooks, metadata) -> torch.Tensor:
    if hooks or metadata or not isinstance(dtype, torch.dtype):
        raise _Declined("a tensor with hooks or metadata")  # a subclass's attributes: torch.load knows them
    data = storage.data.view(dtype) if storage.data.numel() else torch.empty(0, dtype=dtype)
    # as_strided checks that every element lies within the record's bytes
    return data.as_strided(tuple(size), tuple(stride), offset)


_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): dict,
}


class _PlainTensorUnpickler(pickle.Unpickler):
    """Unpickles a tensor's ``data.pkl`` knowing only a plain tensor's few names: nothing else
    can be constructed."""

    def __init__(self, handle: io.BytesIO, storage: Callable[[str, int], torch.Tensor]) -> None:
        super().__init__(handle)
        self._storage = storage

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name)) or _dtype_named(module, name)
        if found is None:
            raise _Declined(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Tuple) -> _Storage:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise _Declined(f"persistent id {kind}")
        return _Storage(dtype, self._storage(str(key), int(numel) * dtype.itemsize))


class _Window(io.RawIOBase):
    """``region[offset:offset + length]`` as a seekable read-only file, for zipfile."""

    def __init__(self, region: Any, offset: int, length: int) -> None:
        super().__init__()
        if offset < 0 or length < 0 or offset + length > len(region):
            raise ValueError("the item lies outside its file")
        self._region, self._offset, self._length, self._position = region, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + position)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._position))
        start = self._offset + self._position
        buffer[:count] = self._region[start : start + count]
        self._position += count
        return count
