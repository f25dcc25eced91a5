"""Real gloo collectives through torchrun's env:// contract, across a restart.

Every rank joins the process group from the environment alone, all-reduces its rank, and
checks the sum; on the first attempt rank 1 then dies, so the second attempt must rendezvous
again on a fresh store.
"""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank)])
dist.all_reduce(value)
expected = world * (world - 1) / 2
assert value.item() == expected, (value.item(), expected)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank} attempt {attempt} all_reduce ok: {value.item()}", flush=True)
# Every rank has said so before rank 1 dies: else a rank that lost the CPU between the all-reduce
# and its print is stopped first (seen on a loaded machine).
dist.barrier()
if attempt == 0 and rank == 1:
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
