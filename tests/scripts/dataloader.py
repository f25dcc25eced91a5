"""A rank that reads through a real multi-process DataLoader; rank 1 dies while loading.

The DataLoader's worker processes are the worker's children: the supervisor must stop them
too, both for the rank that died (orphans) and for the ranks it stops.
"""

import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

READY = Path(os.environ["READY_DIR"])
RANK = int(os.environ["RANK"])


class Slow(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        info = get_worker_info()
        mark = READY / f"rank_{RANK}.loader_{info.id}.pid"
        if not mark.exists():
            mark.write_text(str(os.getpid()))
        time.sleep(0.01)
        return torch.tensor([index])


loader = DataLoader(Slow(), batch_size=4, num_workers=2)
for step, _batch in enumerate(loader):
    if step == 20 and RANK == 1:
        print(f"rank {RANK}: loader workers up, dying", flush=True)
        os._exit(1)
