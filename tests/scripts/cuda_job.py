"""A job whose library touches CUDA at import (cuda_touch/touch_cuda.py, on PYTHONPATH): each rank
joins the group ftlaunch chose (NCCL on GPUs, gloo on CPUs), all-reduces its rank + 1 on its
device and says where and what it got."""

import torch
import torch.distributed as dist
import touch_cuda

import worker_lib as ft

info = ft.init()
total = torch.tensor([info.rank + 1.0], device=info.device)
dist.all_reduce(total)
print(
    f"rank {info.rank} on {total.device} ({touch_cuda.HOW} at import): all-reduce {total.item():g}",
    flush=True,
)
ft.shutdown()
