"""DDP with no worker_lib: what a torchrun user brings. A tiny model trains on gloo for
``--steps`` steps (each a real all-reduce of its gradients), saves its own checkpoint with
torch.save every ``--save-every`` steps (rank 0, written to a temporary name then renamed) and
resumes from it; ftlaunch sees no step of it. It starts a new DDP at each save, as a run resumed
there does, so that a resumed run ends bit-identical to one never stopped at any world size.

``--ready-dir``: writes <dir>/rank_<r>.attempt_<a> after its first step, so that a test can act
while every rank is inside its collectives. ``--out``: rank 0 writes the final weights there.
``--until-attempt N``: in attempts before N it steps on past ``--steps`` until stopped (until.py).
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from until import add_option, steps

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ckpt", type=Path, required=True, help="the script's own checkpoint file")
    p.add_argument("--ready-dir", type=Path)
    p.add_argument("--out", type=Path)
    add_option(p)
    return p.parse_args()


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = 0
    if args.ckpt.exists():
        saved = torch.load(args.ckpt)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"] + 1
    print(f"rank {RANK} attempt {ATTEMPT} starts at step {start}", flush=True)
    print(f"rank {RANK} attempt {ATTEMPT} has WORLD_SIZE {dist.get_world_size()}", flush=True)
    for step in steps(start, args.steps, ATTEMPT, args.until_attempt):
        g = torch.Generator().manual_seed(step * 1000 + RANK)
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # the all-reduce: blocks until every rank's gradients arrive
        opt.step()
        if step == start and args.ready_dir is not None:
            args.ready_dir.mkdir(parents=True, exist_ok=True)
            (args.ready_dir / f"rank_{RANK}.attempt_{ATTEMPT}").write_text(str(step))
        if RANK == 0 and (step + 1) % args.save_every == 0:
            tmp = args.ckpt.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.ckpt)
        dist.barrier()  # no rank runs ahead of rank 0's save
        if (step + 1) % args.save_every == 0:
            # A run resumed here starts with a new DDP, whose first step sums the gradients in
            # another order (docs/reliability.md, "What bit-identical means"): so does this one.
            model = DistributedDataParallel(model.module)
        time.sleep(args.step_time)
    if RANK == 0 and args.out is not None:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
