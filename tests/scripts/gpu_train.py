"""DDP over NCCL on this rank's GPU through worker_lib's checkpoints: an MLP and AdamW, all state
on the device, deterministic given its arguments, so a resumed run ends bit-identical to one that
never stopped only if the model, the optimizer and the CUDA RNG came back exactly.

    ftlaunch --nproc 1 --checkpoint-dir DIR gpu_train.py --out W.pt [--memory-every 1] [--crash 12]
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import argparse  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import worker_lib as ft  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--save-every", type=int, default=5, help="steps between storage saves")
    p.add_argument("--memory-every", type=int, default=0, help="steps between memory snapshots (0: none)")
    p.add_argument("--crash", type=int, help="SIGKILL itself after this step's backward, in attempt 0")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    args = parse()
    info = ft.init()
    assert info.backend == "nccl", info
    torch.use_deterministic_algorithms(True)
    device = torch.device(info.device)
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = ft.load_checkpoint()
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start = ckpt.step
        where = {str(t.device) for t in ckpt.state["model"].values()}
        print(f"rank {info.rank} restored its model onto {sorted(where)}", flush=True)
    print(f"rank {info.rank} attempt {info.attempt} starts at step {start}", flush=True)
    ddp = DDP(model, device_ids=[device.index])
    for step in range(start, args.steps):
        x = torch.randn(64, width, generator=torch.Generator().manual_seed(step)).to(device)
        y = x + 0.1 * torch.randn(64, width, device=device)  # the CUDA RNG: restored on resume
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        if args.crash == step and info.attempt == 0:
            ft.wait_for_checkpoint()  # saves and snapshots so far are whole: what the crash loses is known
            print(f"rank {info.rank}: crash at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        time.sleep(args.step_time)
        ft.heartbeat(step + 1)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if args.memory_every and (step + 1) % args.memory_every == 0:
            ft.save_checkpoint(step + 1, state, to="memory")
        if (step + 1) % args.save_every == 0:
            ft.save_checkpoint(step + 1, state, metrics={"loss": loss.item()}, replicated=True)
    ft.wait_for_checkpoint()
    if info.rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
