"""Checkpoints of GPU state at the copy engine's speed (issue 32): one process, one GPU.

    python scripts/bench_gpu.py [--sizes 400M,1.6G] [--device cuda|cpu] [--repeats 10]
                                [--sections copies,storage,memory,load] [--dir /dev/shm]

For each size, an MLP and its AdamW state (model + two moments ≈ the size) on the device, and
rows in milliseconds beside **the floor**: the pinned device-to-host copy of the same state,
measured in the same run. Plain torch baselines side by side (``tensor.cpu()``, ``torch.save``
of the state). The bounds are issue 32's: a storage save blocks the loop ≤ 2× the floor; a step
with a storage save, and a step with a memory snapshot, take ≤ 1.1× the floor more than a step
without; a memory step loads into the GPU in ≤ 3× the floor.

``--device cpu`` dry-runs every section here (the floor is then a copy into a preallocated CPU
buffer, and the memory tier's flat slots meet ``torch.save`` into /dev/shm, what it did before).

Sections: each is a function ``section(setup) -> rows`` (``Setup`` below: the device, the model,
its state, a training step, the floor). A name given to ``--sections`` that is not one of
``SECTIONS`` is imported from ``scripts/bench_gpu_<name>.py``, whose ``section(setup)`` is called
the same way, so another measurement joins this table without touching this file.
"""

import argparse
import dataclasses
import importlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from worker_lib.checkpoint import premapped  # noqa: E402
from worker_lib.checkpoint.flat import split  # noqa: E402
from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel  # noqa: E402
from worker_lib.checkpoint.memory import MemorySnapshots  # noqa: E402
from worker_lib.checkpoint.memory_slots import SlotFiles  # noqa: E402
from worker_lib.checkpoint.staging import HostBuffer, copy_in  # noqa: E402
from worker_lib.core.contract import LOADED_MEMORY, LOADED_STORAGE  # noqa: E402
from worker_lib.core.storage import Storage  # noqa: E402

Row = List[str]  # size, what, ms, × floor, bound


@dataclasses.dataclass
class Setup:
    """What every section measures against: one size's model, optimizer and floor."""

    device: torch.device
    label: str  # "400M"
    nbytes: int  # of the state's tensors
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: torch.Tensor
    repeats: int
    work: Path  # a folder on disk (storage saves)
    shm: Path  # a folder in /dev/shm (the memory tier)
    floor: float = 0.0  # seconds: the pinned copy of the state to the host

    def state(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def step(self) -> None:
        loss = self.model(self.batch).square().mean()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def row(self, what: str, seconds: List[float], bound: Optional[float] = None, note: str = "") -> Row:
        median = statistics.median(seconds)
        ratio = f"{median / self.floor:.2f}×" if self.floor else ""
        verdict = ""
        if bound is not None and self.floor:
            verdict = f"≤ {bound}×: {'yes' if median <= bound * self.floor else 'NO'}"
        return [self.label, what + (f" ({note})" if note else ""), f"{median * 1000:.1f}", ratio, verdict]


def timed(
    action: Callable[[], object], repeats: int, before: Callable[[], object] = lambda: None
) -> List[float]:
    times = []
    for _ in range(repeats):
        before()  # untimed
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return times


# -- sections ---------------------------------------------------------------------------------


def copies(setup: Setup) -> List[Row]:
    """The floor and the plain ways a state leaves the device."""
    parts = split(setup.state(), copy_objects=True)
    buffer = HostBuffer(parts.layout.size)
    if setup.device.type == "cuda":
        assert buffer.pin(), "CUDA refused to register the floor's buffer"
    views = buffer.views(parts.layout)

    def pinned_copy() -> None:
        for event in copy_in(parts.tensors, views):
            event.synchronize()

    pinned_copy()  # first touch of the pages, untimed
    setup.floor = statistics.median(timed(pinned_copy, setup.repeats))
    gbps = setup.nbytes / setup.floor / 1e9
    buffer.close()
    plain = setup.shm / "plain.pt"
    rows = [
        setup.row("training step, no checkpoint", timed(lambda: (setup.step(), setup.sync()), setup.repeats)),
        setup.row(
            "the floor: pinned device-to-host copy of the state", [setup.floor], note=f"{gbps:.1f} GB/s"
        ),
        setup.row(
            "torch: tensor.cpu() of each tensor",
            timed(lambda: [t.cpu() for t in parts.tensors], 3),
        ),
        setup.row(
            "torch: torch.save of the state into /dev/shm", timed(lambda: torch.save(setup.state(), plain), 3)
        ),
    ]
    plain.unlink()
    return rows


def storage(setup: Setup) -> List[Row]:
    """ft.save_checkpoint to --dir: what the loop is blocked for, and what a step with a save
    costs beyond a step without (the previous save's write is waited for, untimed)."""
    manager = CheckpointManager(Storage(str(setup.work / "ckpt")), 0, 1, LocalChannel(), save_rng=False)
    steps = iter(range(1, 1_000_000))
    manager.save(next(steps), setup.state())  # the staging buffer is made (and pinned) once, untimed
    repeats = min(setup.repeats, 5)  # each save writes the whole state to disk, waited for untimed
    blocked = timed(lambda: manager.save(next(steps), setup.state()), repeats, before=manager.wait)

    def step_with_save() -> None:
        setup.step()
        manager.save(next(steps), setup.state())
        setup.sync()

    plain_step = timed(lambda: (setup.step(), setup.sync()), setup.repeats)
    with_save = timed(step_with_save, repeats, before=manager.wait)
    manager.wait()
    extra = [w - statistics.median(plain_step) for w in with_save]
    plain = setup.work / "plain.pt"
    torch_save = timed(lambda: torch.save(setup.state(), plain), 3)
    pinned = manager.pinned.buffer.size if manager.pinned.buffer else 0
    return [
        setup.row("ft.save_checkpoint (storage): the loop blocked", blocked, 2),
        setup.row("a step with a storage save, beyond a step", extra, 1.1),
        setup.row("torch: torch.save of the state to the same folder", torch_save),
        [setup.label, f"pinned host memory of the storage tier: {pinned / 2**20:.0f} MiB", "", "", ""],
    ]


def memory(setup: Setup) -> List[Row]:
    """ft.save_checkpoint(to="memory") every step, into flat slots in /dev/shm."""
    manager = _with_memory(setup, "memory")
    steps = iter(range(1, 1_000_000))
    for _ in range(2):  # both slots made (and registered) once, untimed
        manager.snapshot(next(steps), setup.state())
    settled = lambda: (setup.sync(), manager.memory.flush())  # noqa: E731 - a step's time has passed
    blocked = timed(lambda: manager.snapshot(next(steps), setup.state()), setup.repeats, before=settled)

    def step_with_snapshot() -> None:
        setup.step()
        manager.snapshot(next(steps), setup.state())
        setup.sync()

    plain_step = timed(lambda: (setup.step(), setup.sync()), setup.repeats)
    with_snapshot = timed(step_with_snapshot, setup.repeats)
    extra = [w - statistics.median(plain_step) for w in with_snapshot]
    manager.memory.close()
    slot = (setup.shm / "memory" / "rank_0.0").stat().st_size
    return [
        setup.row("ft.save_checkpoint(to='memory'): the loop blocked", blocked),
        setup.row("a step with a memory snapshot, beyond a step", extra, 1.1),
        [
            setup.label,
            f"pinned host memory of the memory tier: 2 slots of {slot / 2**20:.0f} MiB",
            "",
            "",
            "",
        ],
    ]


def load(setup: Setup) -> List[Row]:
    """ft.load_checkpoint() into the device, from memory and from storage, as a restarted worker
    does it (a fresh MemorySnapshots: its mappings are not registered), beside the pinned
    host-to-device copy and torch.load(map_location=device)."""
    writer = _with_memory(setup, "load")
    writer.snapshot(1, setup.state())
    writer.save(1, setup.state(), blocking=True)
    writer.memory.close()
    part = setup.work / "load" / "step_1" / "rank_0.pt"
    target = torch.device("cuda", torch.cuda.current_device()) if setup.device.type == "cuda" else "cpu"

    loaded: List[
        MemorySnapshots
    ] = []  # closed (unmapped, unregistered) after the timing: a worker keeps them

    def close_loaded() -> None:
        while loaded:
            loaded.pop().close()

    def restarted(tier: int) -> Callable[[], object]:
        def load_once() -> object:
            memory = (
                MemorySnapshots(setup.shm / "load", 0, 1, LocalChannel()) if tier == LOADED_MEMORY else None
            )
            loaded.extend([memory] if memory is not None else [])
            manager = CheckpointManager(
                Storage(str(setup.work / "load")), 0, 1, LocalChannel(), memory=memory
            )
            found = manager.load()
            assert found is not None and manager.loaded_tier == tier, (found, manager.loaded_tier)
            setup.sync()
            return found

        return load_once

    from_memory = timed(restarted(LOADED_MEMORY), setup.repeats, before=close_loaded)
    # What a warm spare does while parked (launcher/forked/parked_spare.py), untimed: the slots mapped
    # and registered by the process that then loads them.
    ahead = timed(
        restarted(LOADED_MEMORY),
        setup.repeats,
        before=lambda: (
            close_loaded(),
            premapped.look(setup.shm / "load", 0, pin=setup.device.type == "cuda"),
        ),
    )
    close_loaded()
    from_storage = timed(restarted(LOADED_STORAGE), 3)
    torch_load = timed(lambda: (torch.load(part, map_location=target, weights_only=True), setup.sync()), 3)
    return [
        setup.row("ft.load_checkpoint() from memory into the device", from_memory, 3),
        setup.row("the same, its slots mapped and registered ahead (a warm spare's worker)", ahead, 3),
        setup.row("ft.load_checkpoint() from storage (page cache) into the device", from_storage),
        setup.row("torch: torch.load(map_location=device) of the same part", torch_load),
        *_register_rows(setup),
    ]


def _register_rows(setup: Setup) -> List[Row]:
    """What the first snapshot into a slot pays once: registering the slot's mapped file with
    CUDA; and the copy back to the device from registered memory (a process that holds it)."""
    if setup.device.type != "cuda":
        return []
    parts = split(setup.state(), copy_objects=True)
    slot = SlotFiles(setup.shm, 9, 0)  # a rank of its own: the load's slots stay as they are
    slot.buffer_for(parts.layout.size)  # reserved and mapped, as a slot before its first copy

    def register() -> None:
        assert slot.buffer_for(parts.layout.size).pin()

    registering = timed(register, 3, before=slot.release)
    views = slot.buffer_for(parts.layout.size).views(parts.layout)
    fresh = [torch.empty_like(t) for t in parts.tensors]  # not the model's own tensors
    back = timed(
        lambda: ([f.copy_(v, non_blocking=True) for f, v in zip(fresh, views)], setup.sync()), setup.repeats
    )
    slot.discard()
    return [
        setup.row("cudaHostRegister of a slot (once per slot and process)", registering),
        setup.row("pinned host-to-device copy of the state", back),
    ]


def _with_memory(setup: Setup, name: str) -> CheckpointManager:
    memory = MemorySnapshots(setup.shm / name, 0, 1, LocalChannel())
    (setup.shm / name).mkdir()
    return CheckpointManager(
        Storage(str(setup.work / name)), 0, 1, LocalChannel(), save_rng=False, memory=memory
    )


SECTIONS: Dict[str, Callable[[Setup], List[Row]]] = {
    "copies": copies,
    "storage": storage,
    "memory": memory,
    "load": load,
}


def section_named(name: str) -> Callable[[Setup], List[Row]]:
    if name in SECTIONS:
        return SECTIONS[name]
    return importlib.import_module(f"bench_gpu_{name}").section


# -- the run ----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def build(device: torch.device, label: str, size: int, repeats: int, work: Path, shm: Path) -> Setup:
    """An MLP whose parameters and AdamW moments (three copies) come to about ``size`` bytes."""
    params = size // 12
    width = min(4096, max(64, int((params / 2) ** 0.5)))
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(1024 if device.type == "cuda" else 64, width, device=device)
    setup = Setup(device, label, 0, model, optimizer, batch, repeats, work, shm)
    setup.step()  # AdamW's moments exist from the first step on
    setup.sync()
    setup.nbytes = sum(t.numel() * t.element_size() for t in split(setup.state(), copy_objects=False).tensors)
    return setup


def header(device: torch.device) -> str:
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
        return f"{card}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU dry run ({os.cpu_count()} cores), torch {torch.__version__}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="400M,1.6G", help="state sizes, model + AdamW (e.g. 400M,1.6G)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated; see the docstring")
    p.add_argument(
        "--dir", default="/dev/shm", help="where storage saves go (tmpfs: the untimed writes stay short)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the pinned sizes, logged once
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    sections = [section_named(name.strip()) for name in args.sections.split(",") if name.strip()]
    if copies not in sections:
        sections.insert(0, copies)  # the floor every other row is measured against
    rows: List[Row] = []
    for label in args.sizes.split(","):
        work = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-gpu-", dir=args.dir))
        shm = Path(tempfile.mkdtemp(prefix="ftlaunch-bench-gpu-", dir="/dev/shm"))
        try:
            setup = build(device, label, parse_size(label), args.repeats, work, shm)
            for section in sections:
                rows += section(setup)
            rows.append([label, f"(state: {setup.nbytes / 1e6:.0f} MB)", "", "", ""])
            del setup
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{header(device)}; median of {args.repeats} (storage saves: 5; tensor.cpu(), torch.save,")
    print("loads from storage and registering: 3)\n")
    print("| state | what | ms | × floor | bound |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
