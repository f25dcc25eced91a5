"""The CPU memory tier against an earlier version of it and against a plain memcpy: how long a
snapshot (``MemorySnapshots.save``) blocks the training loop, and a load (a fresh
``MemorySnapshots``' vote and read).

    python scripts/bench_memory_tier.py [--against 9e19395] [--sizes 8,64,256] [--saves 13] [--step-ms 30]

``--against``: a git revision whose ``worker_lib/checkpoint/memory.py`` is imported beside today's
(9e19395: the last one that wrote the record and voted inside ``save``; ea1286c: the last one that
wrote each slot with torch.save). The memcpy: the same tensors' bytes, one ``memmove`` each, into
two files in /dev/shm mapped once and written in turn, as the tier's two slots are. The three
take turns, into folders in /dev/shm, so the machine's load meets them alike, each after a step
of ``--step-ms`` of matrix products on this thread (what a training loop does between two
snapshots, and the time today's background part has). A state of 8 float32 tensors per size (MB).
"""

import argparse
import ctypes
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker_lib.checkpoint.flat import Layout  # noqa: E402
from worker_lib.checkpoint.manager import LocalChannel  # noqa: E402
from worker_lib.checkpoint.memory import MemorySnapshots  # noqa: E402
from worker_lib.checkpoint.staging import HostBuffer  # noqa: E402


def module_at(revision: str):
    """The memory tier's module at ``revision`` (where it was then: worker_lib/memory.py before
    worker_lib grew packages; a revision that old imports modules of its own time)."""
    for where in ("worker_lib/checkpoint/memory.py", "worker_lib/memory.py"):
        shown = subprocess.run(["git", "show", f"{revision}:{where}"], cwd=ROOT, capture_output=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-memory-")) / "memory_then.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("memory_then", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.rmtree(path.parent)
    return module


class Memcpy:
    """The floor: ``save`` copies each tensor with one memmove into one of two mapped files in
    ``folder``, in turn (nothing else: no record, no vote)."""

    def __init__(self, folder: Path, tensors: list) -> None:
        self.layout = Layout.of(tensors, [str(i) for i in range(len(tensors))])
        self.buffers = []
        for k in range(2):
            path = folder / f"memcpy.{k}"
            with open(path, "wb") as handle:
                handle.truncate(self.layout.size)
            fd = os.open(path, os.O_RDWR)
            os.posix_fallocate(fd, 0, self.layout.size)
            self.buffers.append(HostBuffer(self.layout.size, fd))
            os.close(fd)
        self.turn = 0

    def save(self, tensors: list) -> None:
        base = self.buffers[self.turn].address
        self.turn = 1 - self.turn
        for tensor, entry in zip(tensors, self.layout.entries):
            ctypes.memmove(base + entry.offset, tensor.data_ptr(), entry.nbytes)

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()


def train_for(seconds: float) -> None:
    """A training step's stand-in: matrix products until ``seconds`` have passed."""
    a = torch.randn(128, 128)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


def measure(then, mb: int, saves: int, step_s: float) -> list:
    per_tensor = mb * 2**20 // 4 // 8
    tensors = [torch.randn(per_tensor) for _ in range(8)]
    payload = {"state": {f"layer{i}": t for i, t in enumerate(tensors)}, "rng": None}
    folders = [Path(tempfile.mkdtemp(prefix="ftlaunch-bench-memory-", dir="/dev/shm")) for _ in range(3)]
    kinds = [then.MemorySnapshots, MemorySnapshots]
    writers = [kind(folder, 0, 1, LocalChannel()) for kind, folder in zip(kinds, folders)]
    floor = Memcpy(folders[2], tensors)
    saved = [[], [], []]  # then, today, memcpy
    read = [[], []]
    try:
        for step in range(1, saves + 3):  # the first two make both slots: not timed
            for i, save in enumerate([w.save for w in writers] + [lambda *_: floor.save(tensors)]):
                train_for(step_s)
                start = time.perf_counter()
                save(step, payload, {})
                if step > 2:
                    saved[i].append(time.perf_counter() - start)
        for writer in writers:
            getattr(writer, "flush", lambda: None)()
        for _ in range(5):
            for i, (kind, folder) in enumerate(zip(kinds, folders)):
                start = time.perf_counter()
                reader = kind(folder, 0, 1, LocalChannel())
                reader.read(reader.newest_agreed(None))
                read[i].append(time.perf_counter() - start)
                getattr(reader, "close", lambda: None)()
    finally:
        writers[1].close()
        floor.close()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    median = [statistics.median(times) for times in saved]
    ms = lambda seconds: f"{seconds * 1000:.1f} ms"  # noqa: E731
    return [
        f"{mb} MB",
        ms(median[2]),
        ms(median[0]),
        ms(median[1]),
        f"{median[1] / median[2]:.2f}x",
        ms(statistics.median(read[0])),
        ms(statistics.median(read[1])),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="9e19395")
    p.add_argument("--sizes", default="8,64,256", help="MB, comma-separated")
    p.add_argument("--saves", type=int, default=13)
    p.add_argument("--step-ms", type=float, default=30.0, help="a training step's time before each save")
    args = p.parse_args()
    then = module_at(args.against)
    rows = [measure(then, int(mb), args.saves, args.step_ms / 1000) for mb in args.sizes.split(",")]
    print(
        f"\nmedian of {args.saves} saves (each after a step of {args.step_ms:g} ms) and 5 reads; "
        "a save's figure: the time the loop is blocked in it\n"
    )
    print(
        f"| state | memcpy | save, {args.against} | save, today | today / memcpy | read, {args.against} "
        "| read, today |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
