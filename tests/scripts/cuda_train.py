"""DDP training on this rank's GPU through worker_lib's checkpoints, for tests/gpu: deterministic
given its arguments (cuBLAS with CUBLAS_WORKSPACE_CONFIG set, deterministic algorithms), so a run
resumed after a crash ends with the weights of a run that never stopped only if the model, the
optimizer and every RNG were restored.

    cuda_train.py --out OUT_DIR [--steps 12] [--save-every 5] [--crash STEP] [--memory]
                  [--wait-for-spare]

``--memory``: a memory-tier snapshot after every step, and before its crash rank 0 waits (60 s
at most) until another process (its warm spare) maps both of its slots; worker_lib's log lines
go to stderr. ``--wait-for-spare``: before its crash rank 0 waits (60 s at most) until every
local rank's warm spare for the restart is warm (ps shows ``ftlaunch-spare K ready``): a restart
never waits for a spare still warming up.

Before it touches CUDA it writes OUT_DIR/rank_<r>.attempt_<a>.json: its pid, whether CUDA was
already initialized in it, its current device then, and on which GPUs a primary context exists
(a warm spare makes them before the script runs). Rank 0 SIGKILLs itself at step --crash of
attempt 0; at the end rank 0 writes OUT_DIR/weights.pt.
"""

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import worker_lib as ft
from launcher.forked.protocol import SPARE_TITLE


def seen_before_cuda() -> dict:
    initialized = torch.cuda.is_initialized()
    return {
        "pid": os.getpid(),
        "initialized": initialized,
        "device": torch.cuda.current_device() if initialized else None,
        "contexts": [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())],
    }


def wait_for(seen) -> None:
    """Until ``seen()``, 60 s at most."""
    deadline = time.monotonic() + 60
    while not seen():
        if time.monotonic() > deadline:
            raise SystemExit(f"not seen within 60 s: {seen}")
        time.sleep(0.05)


def spares_ready() -> bool:
    """Whether every local rank's warm spare for the restart is warm: this run's spares, the
    children of this worker's supervisor (another run's, beside it on the machine, do not count)."""
    shown = {tuple(_cmdline(pid)) for pid in _pids() if _parent(pid) == os.getppid()}
    return all((SPARE_TITLE, str(k), "ready") in shown for k in range(int(os.environ["LOCAL_WORLD_SIZE"])))


def slots_mapped_by_another(rank: int) -> bool:
    """Whether a process other than this one (its warm spare) maps both of this rank's
    memory-tier slots, as /proc/PID/maps shows (the last snapshot's record written first)."""
    ft.wait_for_checkpoint()
    folder = os.environ["FTLAUNCH_MEMORY_DIR"]
    wanted = {f"{folder}/rank_{rank}.{slot}" for slot in (0, 1)}
    for pid in _pids():
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        if all(path in maps for path in wanted):
            return True
    return False


def _pids():
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _cmdline(pid: int) -> list:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:3]
    except OSError:
        return []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--crash", type=int, default=-1)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--wait-for-spare", action="store_true")
    args = p.parse_args()
    if args.memory:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    (args.out / f"rank_{rank}.attempt_{attempt}.json").write_text(json.dumps(seen_before_cuda()))
    torch.use_deterministic_algorithms(True, warn_only=True)  # the weights compared say the rest
    info = ft.init()
    device = torch.device(info.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = ft.load_checkpoint()
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start = ckpt.step
    ddp = DDP(model, device_ids=[device.index])
    for step in range(start, args.steps):
        if step == args.crash and attempt == "0" and info.rank == 0:
            if args.wait_for_spare:
                wait_for(spares_ready)
            if args.memory:
                wait_for(lambda: slots_mapped_by_another(info.rank))
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step * 100 + info.rank)).to(device)
        noise = 0.1 * torch.randn(32, 8, device=device)  # the CUDA RNG: restored on resume, or not equal
        loss = torch.nn.functional.mse_loss(ddp(x), x[:, :8] + noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.memory:
            ft.save_checkpoint(
                step + 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, to="memory"
            )
        if (step + 1) % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            ft.save_checkpoint(step + 1, state, replicated=True)
    ft.wait_for_checkpoint()
    if info.rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out / "weights.pt")
    dist.barrier()
    ft.shutdown()


if __name__ == "__main__":
    main()
