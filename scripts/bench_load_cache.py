"""Would prefetching the newest checkpoint into the page cache, while the old group stops, make a
restart's load faster? worker_lib's load of one rank's part with the file in the page cache
(as right after it was written), evicted from it, and evicted then prefetched
(POSIX_FADV_WILLNEED) with the head start a fork-server restart gives (stop + spawn, --head-start).

    python scripts/bench_load_cache.py [--mb 256] [--repeats 5] [--head-start 0.25]
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
from worker_lib.core.storage import Storage


def _advise(files: List[Path], advice: int) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--head-start", type=float, default=0.25, help="seconds between prefetch and load")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-cache-", dir=Path.cwd()))  # a real disk, not tmpfs
    try:
        state = {f"layer{i}": torch.randn(16 * 2**20 // 4) for i in range(max(1, args.mb // 16))}
        CheckpointManager(Storage(str(root)), 0, 1, LocalChannel(), save_rng=False).save(
            1, state, blocking=True
        )
        files = [f for f in root.rglob("*") if f.is_file()]

        def load() -> float:
            started = time.perf_counter()
            found = CheckpointManager(Storage(str(root)), 0, 1, LocalChannel(), save_rng=False).load()
            assert found is not None and found.step == 1
            return time.perf_counter() - started

        def raw() -> float:
            started = time.perf_counter()
            for path in files:
                path.read_bytes()
            return time.perf_counter() - started

        cases: Dict[str, Callable[[], None]] = {
            "in the page cache": lambda: raw(),
            "evicted": lambda: _advise(files, os.POSIX_FADV_DONTNEED),
            f"evicted, prefetched {args.head_start:g} s before": lambda: (
                _advise(files, os.POSIX_FADV_DONTNEED),
                _advise(files, os.POSIX_FADV_WILLNEED),
                time.sleep(args.head_start),
            ),
        }
        timed: Dict[str, Dict[str, List[float]]] = {name: {"load": [], "read": []} for name in cases}
        for _ in range(args.repeats):
            for name, before in cases.items():
                before()
                timed[name]["read"].append(raw())
                before()
                timed[name]["load"].append(load())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\nOne rank's checkpoint of {args.mb} MB on local disk, median of {args.repeats} (min–max), "
        "seconds\n"
    )
    print("| file | raw read | worker_lib load (read, verify, deserialize) |")
    print("|---|---|---|")
    for name, t in timed.items():
        cells = [f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})" for v in (t["read"], t["load"])]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
