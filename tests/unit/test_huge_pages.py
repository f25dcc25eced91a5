"""The zygote's memory as huge-page pieces (launcher.forked.linux): what a fork copies page table
by page table, found in /proc/PID/maps."""

import ctypes
import mmap

import pytest

from launcher.forked.linux import anonymous_pieces, huge_pages_allowed, pieces_of, resident_share

_HUGE = 2 << 20
MAPS = """\
55d0c4a00000-55d0c4e00000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
7f0000a00000-7f0000c00000 r--p 00000000 00:00 0
7f0000c00000-7f0000e00000 rw-s 00000000 00:05 1234                       /dev/zero (deleted)
7f0001000000-7f0001400000 rw-p 00000000 08:01 99                         /usr/lib/libtorch_cpu.so
7f0002000000-7f0002100000 rw-p 00000000 00:00 0
7f0003001000-7f0003600000 rw-p 00000000 00:00 0
7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_private_writable_anonymous_memory_counts_cut_on_huge_page_boundaries():
    pieces = pieces_of(MAPS.splitlines(), size=4 << 20)
    assert pieces == [
        (0x55D0C4A00000, 4 << 20),  # the heap
        (0x7F0000000000, 4 << 20),  # 10 MiB: 4 + 4 + 2
        (0x7F0000400000, 4 << 20),
        (0x7F0000800000, 2 << 20),
        # read-only, shared, a library's data, less than a huge page, the stack: none
        (0x7F0003200000, 4 << 20),  # a start off the boundary: from the next one, to the last one
    ]


def test_a_private_anonymous_mapping_of_this_process_is_found_whole():
    mapping = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    try:
        address = ctypes.addressof(view)
        inner = range(address + (-address % _HUGE), (address + len(mapping)) // _HUGE * _HUGE, _HUGE)
        covered = {at for start, n in anonymous_pieces() for at in range(start, start + n, _HUGE)}
        assert set(inner) <= covered
    finally:
        del view
        mapping.close()


def _region(address: int) -> dict:
    """/proc/self/smaps's numbers (kB) for the mapping that holds ``address``."""
    found, numbers = False, {}
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                if found:
                    break
                found = start <= address < end
            elif found and fields[0].endswith(":") and len(fields) >= 2 and fields[1].isdigit():
                numbers[fields[0][:-1]] = int(fields[1])
    return numbers


def test_the_zygote_collapses_memory_in_use_and_leaves_memory_hardly_written():
    """A preloaded module that reserved 64 MiB and wrote a byte every 2 MiB keeps 64 KiB of it in
    memory, not 64 MiB (found from outside: 512 MiB so made the zygote's 294 MB 807); 64 MiB
    written whole is collapsed."""
    from launcher.forked.zygote import to_huge_pages

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    used, sparse = mmap.mmap(-1, 64 << 20, flags=flags), mmap.mmap(-1, 64 << 20, flags=flags)
    used_view, sparse_view = ctypes.c_char.from_buffer(used), ctypes.c_char.from_buffer(sparse)
    try:
        used.write(b"x" * len(used))
        for at in range(0, len(sparse), _HUGE):
            sparse[at] = 1
        if not to_huge_pages() or _region(ctypes.addressof(used_view)).get("AnonHugePages", 0) == 0:
            pytest.skip("this kernel cannot collapse memory to huge pages (MADV_COLLAPSE: Linux 6.1, THP on)")
        # 32 pages written of 16,384: a huge page over any of them would have brought in 511 more
        assert resident_share(ctypes.addressof(sparse_view), len(sparse)) < 0.01
    finally:
        del used_view, sparse_view
        used.close()
        sparse.close()


def test_how_much_of_a_range_is_in_memory():
    mapping = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    try:
        start = ctypes.addressof(view)
        assert resident_share(start, 8 << 20) == 0.0  # reserved, never written
        mapping.write(b"x" * (2 << 20))
        assert resident_share(start, 8 << 20) == 0.25
    finally:
        del view
        mapping.close()


def test_an_administrators_never_is_honoured(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert not huge_pages_allowed(str(setting))
    setting.write_text("always [madvise] never\n")
    assert huge_pages_allowed(str(setting))
    assert not huge_pages_allowed(str(tmp_path / "absent"))  # a kernel without THP
