"""A DDP script that must work at any world size, one rank included: ft.init() joins the group."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import worker_lib as ft

info = ft.init()
model = DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()
print(
    f"rank {dist.get_rank()} of {dist.get_world_size()}: DDP step done ({info.world_size} rank(s))",
    flush=True,
)
ft.shutdown()
