"""The zygote's memory as huge-page pieces (launcher.process.linux): what a fork copies page table
by page table, found in /proc/PID/maps."""

import ctypes
import mmap

from launcher.process.linux import anonymous_pieces, pieces_of

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
