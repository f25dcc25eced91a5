"""Directory-mode checkpoints: each rank writes its own shard file (as torch.distributed.checkpoint
does) and rank 0 a shared one; after a crash every rank finds all files in one local directory."""

import logging
import os
import signal
from pathlib import Path

import worker_lib as ft

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
info = ft.init(init_process_group=False)
found = ft.latest_checkpoint_dir()
if found is None:
    for step in (10, 20):
        with ft.checkpoint_dir(step) as folder:
            Path(folder, f"shard_{info.rank}.bin").write_bytes(bytes([info.rank]) * 1000 * step)
            if info.rank == 0:
                Path(folder, "meta").mkdir()
                Path(folder, "meta", "config.json").write_text(f'{{"step": {step}}}')
    ft.wait_for_checkpoint()  # on rank 0: until both steps are committed
    if info.rank == 0:
        print("rank 0 committed; dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(0)
names = sorted(str(p.relative_to(found)) for p in Path(found).rglob("*") if p.is_file())
sizes = [Path(found, f"shard_{r}.bin").stat().st_size for r in range(info.world_size)]
print(f"rank {info.rank} found {names} sizes {sizes}", flush=True)
ft.shutdown()  # the node's fetched copy goes
