"""The CPU memory tier against an earlier version of it: a snapshot (``MemorySnapshots.save``: the
copy, the record, one rank's vote) and a load (a fresh ``MemorySnapshots``' vote and read).

    python scripts/bench_memory_tier.py [--against ea1286c] [--sizes 8,64,256] [--saves 13]

``--against``: a git revision whose ``worker_lib/checkpoint/memory.py`` is imported beside today's (ea1286c:
the last one that wrote each slot with torch.save). Both write into folders in /dev/shm,
alternately, so the machine's load meets both alike. A state of 8 float32 tensors per size (MB).
"""

import argparse
import importlib.util
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

from worker_lib.checkpoint.manager import LocalChannel  # noqa: E402
from worker_lib.checkpoint.memory import MemorySnapshots  # noqa: E402


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


def measure(then, mb: int, saves: int) -> list:
    per_tensor = mb * 2**20 // 4 // 8
    payload = {"state": {f"layer{i}": torch.randn(per_tensor) for i in range(8)}, "rng": None}
    folders = [Path(tempfile.mkdtemp(prefix="ftlaunch-bench-memory-", dir="/dev/shm")) for _ in range(2)]
    kinds = [then.MemorySnapshots, MemorySnapshots]
    writers = [kind(folder, 0, 1, LocalChannel()) for kind, folder in zip(kinds, folders)]
    saved = [[], []]
    read = [[], []]
    try:
        for step in range(1, saves + 3):  # the first two make both slots: not timed
            for i, writer in enumerate(writers):
                start = time.perf_counter()
                writer.save(step, payload, {})
                if step > 2:
                    saved[i].append(time.perf_counter() - start)
        for _ in range(5):
            for i, (kind, folder) in enumerate(zip(kinds, folders)):
                start = time.perf_counter()
                reader = kind(folder, 0, 1, LocalChannel())
                reader.read(reader.newest_agreed(None))
                read[i].append(time.perf_counter() - start)
                getattr(reader, "close", lambda: None)()
    finally:
        writers[1].close()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    ms = lambda times: f"{statistics.median(times) * 1000:.1f} ms"  # noqa: E731
    return [f"{mb} MB", ms(saved[0]), ms(saved[1]), ms(read[0]), ms(read[1])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="ea1286c")
    p.add_argument("--sizes", default="8,64,256", help="MB, comma-separated")
    p.add_argument("--saves", type=int, default=13)
    args = p.parse_args()
    then = module_at(args.against)
    rows = [measure(then, int(mb), args.saves) for mb in args.sizes.split(",")]
    print(f"\nmedian of {args.saves} saves and 5 reads; {args.against} beside today's\n")
    print(f"| state | save, {args.against} | save, today | read, {args.against} | read, today |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
