"""Train a small model sharded with FSDP2 (``fully_shard``) and checkpoint it with
torch.distributed.checkpoint through worker_lib: a job saved by N ranks resumes at any number.

    ftlaunch --nproc 2 --checkpoint-dir runs/fsdp examples/fsdp_train.py --steps 200
    ftlaunch --nproc 4 --checkpoint-dir runs/fsdp examples/fsdp_train.py --steps 400   # goes on at 4

Each attempt builds and shards the model and optimizer for its own world size, then loads the
newest committed step into them (``ft.load_checkpoint(into=state)``: each rank reads only the
chunks of its shards). Saves are asynchronous (``format="dcp"``: the shards are copied to CPU
memory at the call) and committed once every rank's files are written; a preemption stops every
rank at one agreed step, which is saved. On GPUs the mesh is CUDA and the backend NCCL; on CPUs,
gloo. ``--out``: rank 0 writes the model's full tensors there at the end.

On GPUs it follows the GPU recipe: each rank's shards are snapshotted into ftlaunch's node-local
memory tier after every step (``--memory-every``, default 1 on GPUs, 0 on CPUs), storage every
``--save-every`` steps; a crash then costs only the step it interrupted.
"""

import argparse
import os
import time

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import worker_lib as ft


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--blocking", action="store_true", help="save synchronously")
    p.add_argument(
        "--memory-every",
        type=int,
        default=None,
        help="steps between snapshots into ftlaunch's memory tier (0: none; default: 1 on GPUs, 0 on CPUs)",
    )
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep in each step")
    p.add_argument("--out", default=None)
    return p.parse_args()


def build(info):
    """The model and its optimizer, sharded over every rank of this attempt."""
    device = torch.device(info.device)
    mesh = init_device_mesh(device.type, (info.world_size,))
    torch.manual_seed(0)  # the same initial weights everywhere, whatever the sharding
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer, device


def memory_every(args, device: torch.device) -> int:
    """Steps between memory snapshots: --memory-every, else the GPU recipe (every step) where
    ftlaunch gave the node a memory tier and the rank trains on a GPU, where the copy is the
    device's; none on CPUs, where it would take cores from training, nor under plain torchrun."""
    if args.memory_every is not None:
        return args.memory_every
    tier = ft.contract.FT_MEMORY_DIR in os.environ  # ftlaunch's, in /dev/shm
    return 1 if tier and device.type == "cuda" else 0


def state_of(model, optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's shards
    return {"model": model_state, "optim": optim_state}


def main() -> None:
    args = parse()
    info = ft.init()
    model, optimizer, device = build(info)
    snapshot_every = memory_every(args, device)
    model(torch.zeros(1, 16, device=device)).sum().backward()  # Adam's state exists, to load into
    optimizer.step()
    optimizer.zero_grad()

    state = state_of(model, optimizer)
    found = ft.load_checkpoint(into=state)  # the newest committed step, resharded to this size
    start = found.step if found else 0
    if found:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    print(f"rank {info.rank} of {info.world_size} attempt {info.attempt} starts at step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + info.rank)  # data by step: a resume replays it
        loss = model(torch.randn(8, 16, generator=g).to(device)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_time)
        ft.heartbeat(step)
        stop = ft.should_stop(step)  # a preemption: every rank saves this step and leaves
        if stop or step % args.save_every == 0:
            ft.save_checkpoint(step, state_of(model, optimizer), format="dcp", blocking=args.blocking)
        elif snapshot_every and step % snapshot_every == 0:  # this rank's shards, in the node's memory
            ft.save_checkpoint(step, state_of(model, optimizer), format="dcp", to="memory")
        if stop:
            break
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}  # a collective
    if info.rank == 0 and args.out:
        torch.save({name: value.cpu() for name, value in full.items()}, args.out)
    ft.shutdown()


if __name__ == "__main__":
    main()
