"""FSDP2 (``fully_shard`` on a CPU mesh, gloo) checkpointed with ``ft.save_checkpoint(format="dcp")``.

Each attempt loads the newest committed step into its freshly sharded model and optimizer (any
world size), trains to ``--steps`` saving every ``--save-every``, and rank 0 writes the model's
full tensors to ``--out``. ``--load-only``: load, write the full tensors, train nothing.
"""

import argparse

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import worker_lib as ft


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--load-only", action="store_true")
    p.add_argument("--blocking", action="store_true")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    args = parse()
    info = ft.init()
    mesh = init_device_mesh("cpu", (info.world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 16)).sum().backward()  # Adam's state exists, to be loaded into
    optimizer.step()
    optimizer.zero_grad()

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    found = ft.load_checkpoint(into=state)
    start = found.step if found else 0
    if found:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    print(f"rank {info.rank} of {info.world_size} attempt {info.attempt} starts at step {start}", flush=True)
    for step in range(start, 0 if args.load_only else args.steps):
        g = torch.Generator().manual_seed(step * 100 + info.rank)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ft.heartbeat(step + 1)
        if (step + 1) % args.save_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            ft.save_checkpoint(
                step + 1, {"model": model_state, "optim": optim_state}, format="dcp", blocking=args.blocking
            )
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}
    if info.rank == 0:
        torch.save(full, args.out)
    ft.shutdown()


if __name__ == "__main__":
    main()
