"""CRC32C, the checksum of checkpoint files: incremental over any buffer, and the form GCS keeps."""

import base64
import hashlib
import mmap
import os

import google_crc32c
import pytest

from worker_lib.core import checksum


@pytest.fixture(params=["library", "extension"])
def crc_path(request, monkeypatch):
    """Both ways to compute a CRC32C: the C library through ctypes (where google_crc32c has it,
    as on this machine), and google_crc32c's extension given bytes."""
    if request.param == "library":
        assert checksum._NATIVE is not None  # the Linux wheel ships the library
    else:
        monkeypatch.setattr(checksum, "_NATIVE", None)
    return request.param


def test_crc32c_over_pieces_and_buffers_equals_the_one_of_the_whole(crc_path):
    data = os.urandom(3 * 2**20 + 17)  # more than one of the megabyte pieces buffers are cut into
    whole = f"{google_crc32c.value(data):08x}"
    for feed in (
        [data],
        [data[:5], data[5:]],
        [memoryview(data)],
        [bytearray(data)],
        [memoryview(data)[: 2**20 + 1], memoryview(data)[2**20 + 1 :]],
    ):
        summer = checksum.new()
        for piece in feed:
            summer.update(piece)
        assert summer.hexdigest() == whole


@pytest.mark.parametrize("access", [mmap.ACCESS_READ, mmap.ACCESS_COPY])  # read-only; in place
def test_crc32c_of_a_mapped_file(tmp_path, crc_path, access):
    data = os.urandom(2**20 + 3)
    path = tmp_path / "part"
    path.write_bytes(data)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=access) as region:
        summer = checksum.new()
        view = memoryview(region)
        summer.update(view)
        view.release()
    assert summer.hexdigest() == f"{google_crc32c.value(data):08x}"


def test_the_crc32c_of_two_ranges_combines_into_the_one_of_the_whole():
    data = os.urandom(100_003)
    for cut in (0, 1, 7, 4096, 50_000, 100_002, 100_003):
        a, b = data[:cut], data[cut:]
        assert checksum.combine(
            google_crc32c.value(a), google_crc32c.value(b), len(b)
        ) == google_crc32c.value(data)


def test_sha256_for_markers_of_earlier_versions_and_nothing_else():
    summer = checksum.new(checksum.SHA256)
    summer.update(memoryview(b"abc"))
    assert summer.hexdigest() == hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        checksum.new("md5")


def test_the_crc32c_an_object_store_keeps():
    stored = base64.b64encode(google_crc32c.value(b"hello").to_bytes(4, "big")).decode()
    assert checksum.from_object_info({"crc32c": stored}) == f"{google_crc32c.value(b'hello'):08x}"
    for info in ({}, {"crc32c": None}, {"crc32c": "not base64!"}, {"crc32c": "AAAA"}, {"crc32c": 5}):
        assert checksum.from_object_info(info) is None  # keeps none we can use: the file is read


@pytest.mark.parametrize("size", [0, 1, 2**20 - 1, 3 * 2**20 + 3])
def test_the_checksum_of_a_file_read_in_pieces(tmp_path, size, crc_path, monkeypatch):
    monkeypatch.setattr(checksum, "_RANGE_MIN", 2**20)  # ranges on threads for files past 2 MB
    data = os.urandom(size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    assert checksum.of_file(str(path)) == (size, f"{google_crc32c.value(data):08x}")
    assert checksum.of_file(str(path), checksum.SHA256) == (size, hashlib.sha256(data).hexdigest())
