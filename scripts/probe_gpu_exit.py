"""How long a SIGKILLed GPU process takes to be gone, by what it holds: what a restart's "started"
phase pays before any launcher can see the death (waitpid returns only once the kernel and the
driver have released everything: its GPU memory, its pinned host memory, its address space).

    python scripts/probe_gpu_exit.py [--device cpu] [--repeats 2]

Each row: a child process that imports torch, makes its CUDA context, allocates GPU memory and
pinned host memory (``cudaHostRegister`` of a shared mapping, as a memory-tier slot), says so on
stdout, then waits; the parent SIGKILLs it and times its stdout's EOF (the descriptor closed as
the kernel closes the process's files) and waitpid's return (the zombie). Median of the repeats.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

CHILD = r"""
import mmap, sys, torch
gpu_bytes, pinned_bytes, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
held = []
if device == "cuda":
    torch.cuda.init()
    held.append(torch.empty(max(gpu_bytes, 1), dtype=torch.uint8, device="cuda").fill_(1))
if pinned_bytes:
    area = mmap.mmap(-1, pinned_bytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    area.write(b"\1" * pinned_bytes)
    if device == "cuda":
        import ctypes
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        assert int(torch.cuda.cudart().cudaHostRegister(address, pinned_bytes, 1)) == 0
    held.append(area)
torch.cuda.synchronize() if device == "cuda" else None
print("ready", flush=True)
sys.stdin.read()
"""

ROWS = [
    ("nothing", 0, 0),
    ("2 GB of GPU memory", 2 * 10**9, 0),
    ("2 GB of GPU memory + 4.5 GB pinned", 2 * 10**9, 45 * 10**8),
]


def once(gpu_bytes: int, pinned_bytes: int, device: str):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(gpu_bytes), str(pinned_bytes), device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    if child.stdout.readline().strip() != b"ready":
        child.kill()
        child.wait()
        raise SystemExit(f"the child did not start (exit {child.wait()})")
    killed = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    child.stdout.read()  # EOF: its files closed
    eof = time.monotonic()
    child.wait()
    return eof - killed, time.monotonic() - killed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print("| what the killed process held | stdout's EOF (ms) | waitpid (ms) |")
    print("|---|---|---|")
    for name, gpu_bytes, pinned_bytes in ROWS:
        runs = [once(gpu_bytes, pinned_bytes, args.device) for _ in range(args.repeats)]
        eof, gone = (statistics.median(r[i] for r in runs) * 1000 for i in (0, 1))
        print(f"| {name} | {eof:.1f} | {gone:.1f} |", flush=True)


if __name__ == "__main__":
    main()
