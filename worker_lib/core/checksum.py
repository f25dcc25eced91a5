"""The checksums of checkpoint files: CRC32C (in hardware, 5x SHA-256's speed, and what GCS keeps
for every object), and SHA-256 for older markers; not a defence against forgery (the weights-only
loader is). google_crc32c's C library is called through ctypes where found, which releases the
GIL, so a file is checked over ranges on several threads and the CRCs combined.
"""

import base64
import ctypes
import hashlib
import importlib
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

import google_crc32c

__all__ = ["ALGORITHMS", "CRC32C", "SHA256", "Checksum", "from_object_info", "new", "of_file"]

CRC32C = "crc32c"
SHA256 = "sha256"  # markers written by earlier versions list it: still verified
ALGORITHMS = (CRC32C, SHA256)
_PIECE = 2**20
_RANGE_MIN = 32 * 2**20  # a file is checked on one more thread per this many bytes...
_THREADS_MAX = 4  # ...up to this many: past it the memory bus, not the CPU, is what is shared


class Checksum(Protocol):
    """Incremental, like hashlib's objects: ``update`` with any bytes-like object."""

    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


def _native_extend() -> Optional[Callable[..., int]]:
    """``crc32c_extend`` of the C library google_crc32c loaded (found in this process's
    mappings); None where there is none."""
    if google_crc32c.implementation != "c":
        return None
    importlib.import_module("google_crc32c._crc32c")  # it loads the library
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[5] for line in maps if len(line.split()) >= 6}
        path = next(p for p in sorted(paths) if os.path.basename(p).startswith("libcrc32c"))
        extend = ctypes.CDLL(path).crc32c_extend
    except (OSError, StopIteration, AttributeError):
        return None
    extend.restype = ctypes.c_uint32
    extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return extend


_NATIVE = _native_extend()


def _extend(crc: int, data: Any) -> int:
    """``crc`` extended by the bytes of ``data`` (any bytes-like object)."""
    if _NATIVE is not None:
        if isinstance(data, bytes):
            return _NATIVE(crc, ctypes.c_char_p(data), len(data))
        view = memoryview(data)
        if not view.readonly and view.c_contiguous:
            view = view.cast("B")
            return _NATIVE(crc, (ctypes.c_char * len(view)).from_buffer(view), len(view))
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _PIECE):
        crc = google_crc32c.extend(crc, view[start : start + _PIECE].tobytes())
    return crc


# CRC-32C's polynomial, bit-reflected; and x^(2^k) modulo it, for k = 0..31 (zlib's combine).
_POLY = 0x82F63B78


def _times_mod_p(a: int, b: int) -> int:
    """a × b modulo the polynomial (bit-reflected, as the CRC keeps them)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


_X_2_K = [1 << 30]  # x^1
for _ in range(31):
    _X_2_K.append(_times_mod_p(_X_2_K[-1], _X_2_K[-1]))


def combine(crc_a: int, crc_b: int, size_b: int) -> int:
    """The CRC32C of A followed by B, from each one's and B's size (zlib's ``crc32_combine``)."""
    shift, k, n = 1 << 31, 3, size_b  # x^(8 × size_b): one x per bit of B
    while n:
        if n & 1:
            shift = _times_mod_p(_X_2_K[k % 32], shift)
        n >>= 1
        k += 1
    return _times_mod_p(shift, crc_a) ^ crc_b


class _Crc32c:
    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Any) -> None:
        self._crc = _extend(self._crc, data)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


class _Sha256:
    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: Any) -> None:
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


_KINDS: Dict[str, Callable[[], Checksum]] = {CRC32C: _Crc32c, SHA256: _Sha256}


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
    """The size and checksum of a local file, read with ``os.preadv`` in megabyte pieces, over
    ranges on several threads where the library releases the GIL; a short file is an OSError."""
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if algorithm != CRC32C or _NATIVE is None:
            summer = new(algorithm)
            _read_range(handle.fileno(), path, 0, size, summer.update)
            return size, summer.hexdigest()
        threads = max(1, min(_THREADS_MAX, len(os.sched_getaffinity(0)), size // _RANGE_MIN))
        bounds = [size * k // threads for k in range(threads + 1)]
        crcs: List[Optional[int]] = [None] * threads
        errors: List[BaseException] = []

        def check(k: int) -> None:
            crc = [0]

            def add(piece: Any) -> None:
                crc[0] = _extend(crc[0], piece)

            try:
                _read_range(handle.fileno(), path, bounds[k], bounds[k + 1], add)
                crcs[k] = crc[0]
            except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
                errors.append(err)

        helpers = [threading.Thread(target=check, args=(k,), daemon=True) for k in range(1, threads)]
        for helper in helpers:
            helper.start()
        check(0)
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]
        whole = 0
        for k, crc in enumerate(crcs):
            if crc is None:  # never: each check sets its range's CRC or records an error
                raise RuntimeError(f"{path}: bytes {bounds[k]}-{bounds[k + 1]} were not checked")
            whole = crc if k == 0 else combine(whole, crc, bounds[k + 1] - bounds[k])
    return size, f"{whole:08x}"


def _read_range(fd: int, path: str, start: int, end: int, add: Callable[[Any], None]) -> None:
    """Give ``add`` the bytes of [start, end) of the file, a reused megabyte buffer at a time."""
    piece = bytearray(min(_PIECE, end - start))
    done = start
    while done < end:
        wanted = min(len(piece), end - done)
        view = memoryview(piece)[:wanted]
        got = os.preadv(fd, [view], done)
        if got == 0:
            raise OSError(f"{path} ended at byte {done}, before the size it had: it changed while read")
        add(view[:got])
        done += got
