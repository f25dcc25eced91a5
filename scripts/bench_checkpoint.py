"""Checkpoint throughput: worker_lib vs plain torch.save / raw reads, on local disk and on the
GCS emulator (fake-gcs-server on 127.0.0.1, through gcsfs).

    python scripts/bench_checkpoint.py [--mb 256] [--repeats 3]

One rank, a state of --mb megabytes of float32 tensors. Rows:
- save, sync: worker_lib's blocking save (serialize, CRC32C, write, fsync, rename, commit)
  beside torch.save of the same state to the same storage
- save, async: how long the training loop is blocked by ft.save_checkpoint (the copy to CPU
  memory), and how long until the background save is committed
- load: worker_lib's load (verify CRC32C, deserialize) beside reading the same bytes raw
- CRC32C of a file (local disk): what a DCP commit computes and a DCP load checks, per file
- DCP save and load: format="dcp" beside torch.distributed.checkpoint's save and load alone;
  on local disk also from a cold page cache, where /proc/sys/vm/drop_caches can be written (root)
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import fsspec  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the storage servers the tests use

from storage_servers import start_gcs  # noqa: E402

from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel  # noqa: E402
from worker_lib.core import checksum  # noqa: E402
from worker_lib.core.storage import Storage  # noqa: E402


def make_state(mb: int) -> Dict[str, torch.Tensor]:
    per_tensor = 16 * 2**20 // 4  # 16 MiB of float32 each
    return {f"layer{i}": torch.randn(per_tensor) for i in range(max(1, mb // 16))}


def timed(action: Callable[[], object], repeats: int, before: Callable[[], object] = list) -> List[float]:
    times = []
    for _ in range(repeats):
        before()  # untimed
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return times


def bench_target(name: str, url: str, state, mb: float, repeats: int) -> List[List[str]]:
    manager = CheckpointManager(Storage(url), 0, 1, LocalChannel(), save_rng=False)
    fs, root = fsspec.core.url_to_fs(url)
    steps = iter(range(1, 10_000))
    plain_names = (f"{root}/plain_{i}.pt" for i in range(10_000))
    written: List[str] = []

    def torch_save(durable: bool = False):
        # A fresh file each time, as checkpoints are: rewriting one file in place reuses its disk
        # blocks and flatters the baseline on this machine's disk.
        path = next(plain_names)
        with fs.open(path, "wb") as handle:
            torch.save(state, handle)
            if durable:  # what a save that survives a power cut also pays (local disk only)
                handle.flush()
                os.fsync(handle.fileno())
        written.append(path)

    def forget_old() -> None:
        """Untimed, on both sides: the previous baseline file deleted; worker_lib's retention
        deleting the step that fell out of keep_last, in the background (the save returns at
        its commit)."""
        manager.wait()
        for old in written[:-1]:
            fs.rm_file(old)
        del written[:-1]

    sync, baseline, durable = [], [], []
    for _ in range(repeats):  # interleaved, so that disk and cache drift hit every column alike
        sync += timed(lambda: manager.save(next(steps), state, blocking=True), 1)
        forget_old()
        baseline += timed(torch_save, 1)
        forget_old()
        if manager.storage.is_local:
            durable += timed(lambda: torch_save(durable=True), 1)
            forget_old()
    plain = written[0]
    blocked, committed = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        manager.save(next(steps), state)
        blocked.append(time.perf_counter() - start)
        manager.wait()
        committed.append(time.perf_counter() - start)
    load = timed(manager.load, repeats)
    raw = timed(lambda: fs.cat_file(plain), repeats)
    med = statistics.median
    checks = []
    if manager.storage.is_local:  # what a DCP load checks (and a DCP commit computes) per file
        checks.append(
            [
                name,
                "CRC32C of a file",
                _rate(mb, med(timed(lambda: checksum.of_file(plain), repeats))),
                f"raw read: {_rate(mb, med(raw))}",
            ]
        )
    plain_save = f"torch.save: {_rate(mb, med(baseline))}"
    if durable:
        plain_save += f"; torch.save + fsync: {_rate(mb, med(durable))}"
    return [
        [name, "save, sync", _rate(mb, med(sync)), plain_save],
        [
            name,
            "save, async: loop blocked",
            f"{med(blocked) * 1000:.0f} ms",
            f"{100 * med(blocked) / med(sync):.1f}% of the sync save; committed after {med(committed):.2f} s",
        ],
        [name, "load", _rate(mb, med(load)), f"raw read: {_rate(mb, med(raw))}"],
        *checks,
    ]


def bench_dcp(name: str, url: str, state, mb: float, repeats: int) -> List[List[str]]:
    """format="dcp" beside torch.distributed.checkpoint alone, writing the same state through
    the same fsspec writer: what ftlaunch's commit adds (the checksums, the RNG part, the
    marker) and its load adds (the verification and the vote). DCP alone reads with the reader
    it picks itself for that storage (``FileSystemReader`` for a local folder); ftlaunch reads a
    local folder through a mapping (worker_lib.checkpoint.dcp_reader)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from worker_lib.checkpoint.dcp import load_dcp, save_dcp

    manager = CheckpointManager(Storage(url), 0, 1, LocalChannel(), save_rng=False)
    steps = iter(range(1, 10_000))
    folders = (manager.storage.url_of(f"plain_dcp_{i}") for i in range(10_000))
    written: List[str] = []

    def dcp_alone() -> None:
        folder = next(folders)
        dcp.save(state, storage_writer=FsspecWriter(folder), no_dist=True)
        written.append(folder)

    def forget_old() -> None:
        manager.wait()
        for old in written[:-1]:
            fsspec.core.url_to_fs(old)[0].rm(old, recursive=True)
        del written[:-1]

    ours, alone = [], []
    for _ in range(repeats):
        ours += timed(lambda: save_dcp(manager, next(steps), state, {}, blocking=True), 1)
        forget_old()
        alone += timed(dcp_alone, 1)
        forget_old()
    into = {key: torch.empty_like(value) for key, value in state.items()}

    def load_alone_once() -> None:
        folder = written[-1]
        local = manager.storage.is_local
        reader = FileSystemReader(fsspec.core.url_to_fs(folder)[1]) if local else FsspecReader(folder)
        dcp.load(into, storage_reader=reader, no_dist=True)

    load_ours, load_alone = [], []
    for _ in range(repeats):
        load_ours += timed(lambda: load_dcp(manager, into), 1)
        load_alone += timed(load_alone_once, 1)
    rows = [
        _beside(name, "DCP save, sync", mb, ours, "dcp.save alone", alone),
        _beside(name, "DCP load", mb, load_ours, "dcp.load alone", load_alone),
    ]
    if manager.storage.is_local and _can_drop_caches():
        # What a restarted job meets on another node or after a reboot: nothing in the page cache.
        cold_ours, cold_alone = [], []
        for _ in range(repeats):
            cold_ours += timed(lambda: load_dcp(manager, into), 1, before=_drop_caches)
            cold_alone += timed(load_alone_once, 1, before=_drop_caches)
        rows.append(_beside(name, "DCP load, cold cache", mb, cold_ours, "dcp.load alone", cold_alone))
    assert all(torch.equal(into[key], state[key]) for key in state)
    return rows


_DROP_CACHES = "/proc/sys/vm/drop_caches"


def _can_drop_caches() -> bool:
    return os.access(_DROP_CACHES, os.W_OK)


def _drop_caches() -> None:
    os.sync()
    with open(_DROP_CACHES, "w") as handle:
        handle.write("1\n")


def _beside(name: str, what: str, mb: float, ours: List[float], label: str, alone: List[float]) -> List[str]:
    med = statistics.median
    return [name, what, _rate(mb, med(ours)), f"{label}: {_rate(mb, med(alone))} ({_over(ours, alone)})"]


def _over(ours: List[float], alone: List[float]) -> str:
    return f"ftlaunch adds {100 * (statistics.median(ours) / statistics.median(alone) - 1):+.0f}%"


def _rate(mb: float, seconds: float) -> str:
    return f"{mb / seconds:.0f} MB/s ({seconds:.2f} s)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    state = make_state(args.mb)
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-ckpt-"))
    server, env = start_gcs(work)
    try:
        fsspec.config.conf["gcs"] = {"token": "anon", "endpoint_url": env["FSSPEC_GCS_ENDPOINT_URL"]}
        fsspec.filesystem("gcs").mkdir("bench")
        rows = bench_target("local disk", str(work / "local"), state, mb, args.repeats)
        rows += bench_dcp("local disk", str(work / "local-dcp"), state, mb, args.repeats)
        rows += bench_target("GCS emulator", "gcs://bench/run", state, mb, args.repeats)
        rows += bench_dcp("GCS emulator", "gcs://bench/dcp", state, mb, args.repeats)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nCheckpoint of {mb:.0f} MB, 1 rank, median of {args.repeats}\n")
    print("| storage | operation | worker_lib | baseline |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
