"""Where a restarted GPU worker's memory-tier load spends its time, and what the ways around it cost
(issue 32 item 3 and issue 34 item 2: ≤ 3× the pinned copy). One process, one GPU; no ftlaunch.

A slot is a flat file in /dev/shm; a fresh process reads it back onto the GPU. Each way is timed
from nothing mapped to every tensor on the device, the file's pages in memory (tmpfs):

    map+pageable   mmap (MAP_POPULATE) and one copy per tensor from the pageable mapping (today)
    map+register   the same, the mapping registered with CUDA first (cudaHostRegister)
    bounce         chunks copied by the CPU into two pinned buffers, each sent on while the next fills
    pread+bounce   the same, the chunks read from the file (no mapping at all)

    python3 scripts/probe_gpu_load.py --sizes 400M,1.6G [--device cpu for a dry run]
"""

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from typing import Callable, List

import torch

MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
TENSORS = 48  # an MLP's weights, biases and two AdamW moments come to tens of tensors
CHUNK = 64 << 20


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _address(mapping: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def _fresh(device: torch.device, sizes: List[int]) -> List[torch.Tensor]:
    return [torch.empty(n // 4, dtype=torch.float32, device=device) for n in sizes]


def map_pageable(path: str, sizes: List[int], device: torch.device, register: bool) -> List[torch.Tensor]:
    total = sum(sizes)
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | MAP_POPULATE)
    os.close(fd)
    registered = register and device.type == "cuda"
    if registered:
        assert torch.cuda.cudart().cudaHostRegister(_address(mapping), total, 1) == 0
    out, offset = _fresh(device, sizes), 0
    for tensor, n in zip(out, sizes):
        view = torch.frombuffer(mapping, dtype=torch.float32, count=n // 4, offset=offset)
        tensor.copy_(view, non_blocking=registered)
        offset += n
    _sync(device)
    if registered:
        torch.cuda.cudart().cudaHostUnregister(_address(mapping))
    del view
    return out


def bounce(path: str, sizes: List[int], device: torch.device, use_pread: bool) -> List[torch.Tensor]:
    """Two pinned chunks: the CPU fills one while the copy engine empties the other."""
    total = sum(sizes)
    pinned = device.type == "cuda"
    buffers = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
    done = [torch.cuda.Event() if pinned else None for _ in range(2)]
    out = _fresh(device, sizes)
    flat_out = [t.view(torch.uint8) for t in out]
    fd = os.open(path, os.O_RDWR)
    mapping = None if use_pread else mmap.mmap(fd, total, flags=mmap.MAP_SHARED | MAP_POPULATE)
    source = None if use_pread else torch.frombuffer(mapping, dtype=torch.uint8)
    # (tensor index, offset in it) walked chunk by chunk
    index, inside, position, turn = 0, 0, 0, 0
    while position < total:
        buf, event = buffers[turn % 2], done[turn % 2]
        if event is not None:
            event.synchronize()  # the copy engine is through with this buffer
        n = min(CHUNK, total - position)
        if use_pread:
            view = memoryview(buf.numpy())
            got = os.preadv(fd, [view[:n]], position)
            assert got == n
        else:
            buf[:n].copy_(source[position : position + n])
        filled = 0
        while filled < n:
            room = flat_out[index].numel() - inside
            take = min(room, n - filled)
            flat_out[index][inside : inside + take].copy_(buf[filled : filled + take], non_blocking=pinned)
            filled, inside = filled + take, inside + take
            if inside == flat_out[index].numel():
                index, inside = index + 1, 0
        if event is not None:
            event.record()
        position, turn = position + n, turn + 1
    _sync(device)
    os.close(fd)
    del source
    return out


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="400M,1.6G")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    threads = torch.get_num_threads()
    print(
        f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"{threads} CPU threads for torch; median of {args.repeats}, ms"
    )
    print("\n| state | way | ms | × pinned copy |\n|---|---|---|---|")
    for text in args.sizes.split(","):
        rows = _measure(_size(text), device, args.repeats)
        floor = rows[0][1]
        for name, ms in rows:
            print(f"| {text} | {name} | {ms:.1f} | {ms / floor:.2f}× |")


def _measure(asked: int, device: torch.device, repeats: int) -> list:
    total = asked // TENSORS // 4096 * 4096 * TENSORS
    sizes = [total // TENSORS] * TENSORS
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="probe-load-") as handle:
        os.posix_fallocate(handle.fileno(), 0, total)
        src = torch.randn(total // 4)
        os.pwrite(handle.fileno(), src.numpy().tobytes(), 0)
        expected = src[: sizes[0] // 4].to(device)
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        target = torch.empty(total, dtype=torch.uint8, device=device)
        floor = timed(lambda: (target.copy_(pinned, non_blocking=True), _sync(device)), repeats, device)
        rows = [("the floor: one pinned host-to-device copy", floor)]
        rows.append(
            ("allocating the fresh device tensors", timed(lambda: _fresh(device, sizes), repeats, device))
        )
        for name, fn in (
            ("map+pageable (today)", lambda: map_pageable(handle.name, sizes, device, False)),
            ("map+register", lambda: map_pageable(handle.name, sizes, device, True)),
            ("bounce (map, 2 × 64 MiB pinned)", lambda: bounce(handle.name, sizes, device, False)),
            ("pread+bounce (no map)", lambda: bounce(handle.name, sizes, device, True)),
        ):
            check = fn()
            assert torch.equal(check[0], expected), name
            rows.append((name, timed(fn, repeats, device)))
    return rows


if __name__ == "__main__":
    main()
