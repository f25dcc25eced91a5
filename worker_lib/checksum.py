"""The checksums of checkpoint files: CRC32C, and SHA-256 for markers written before it.

Why CRC32C: SHA-256 runs at about 2 GB/s on one core, and was most of the CPU a save or a load
spent beyond the bytes themselves. CRC32C runs in hardware at about 10 GB/s, catches every torn,
truncated, zero-filled or bit-flipped file this checks for, and is what GCS keeps for every object,
so a file another writer made (DCP's) need not be read back there. It is no defence against a
forged checkpoint; torch's weights-only loader is.

The C extension takes only ``bytes``: buffers (torch.save writes memoryviews, an mmap) are copied
to it a megabyte at a time, small enough to stay in the cache.

A file read only to be checked is read with ``os.pread`` in megabyte pieces: the GIL is released
in the read and in the C extension, so a check on a thread of its own overlaps another reader's
Python (DCP's load) rather than competing with it.
"""

import base64
import hashlib
import os
from typing import Any, Mapping, Optional, Protocol, Tuple

import google_crc32c

__all__ = ["ALGORITHMS", "CRC32C", "SHA256", "Checksum", "from_object_info", "new", "of_file"]

CRC32C = "crc32c"
SHA256 = "sha256"  # markers written by earlier versions list it: still verified
ALGORITHMS = (CRC32C, SHA256)
_PIECE = 2**20


class Checksum(Protocol):
    """Incremental, like hashlib's objects: ``update`` with any bytes-like object."""

    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32c:
    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Any) -> None:
        if isinstance(data, bytes):
            self._crc = google_crc32c.extend(self._crc, data)
            return
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _PIECE):
            self._crc = google_crc32c.extend(self._crc, view[start : start + _PIECE].tobytes())

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


class _Sha256:
    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: Any) -> None:
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


_KINDS = {CRC32C: _Crc32c, SHA256: _Sha256}


def new(algorithm: str = CRC32C) -> Checksum:
    if algorithm not in _KINDS:
        raise ValueError(f"unknown checksum {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    return _KINDS[algorithm]()


def from_object_info(info: Mapping[str, Any]) -> Optional[str]:
    """The CRC32C an object store keeps for an object (GCS: base64 of 4 big-endian bytes), in
    ``Checksum``'s form; None where the store keeps none."""
    stored = info.get("crc32c")
    if not isinstance(stored, str):
        return None
    try:
        raw = base64.b64decode(stored, validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 4 else None


def of_file(path: str, algorithm: str = CRC32C) -> Tuple[int, str]:
    """The size and checksum of a local file; a file that ends before its size (it changed under
    the reader) is an OSError."""
    summer = new(algorithm)
    with open(path, "rb", buffering=0) as handle:
        size, done = os.fstat(handle.fileno()).st_size, 0
        while done < size:
            chunk = os.pread(handle.fileno(), min(_PIECE, size - done), done)
            if not chunk:
                raise OSError(f"{path} ended at byte {done}, before its size {size}: it changed while read")
            summer.update(chunk)
            done += len(chunk)
    return size, summer.hexdigest()
