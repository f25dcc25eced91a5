"""The standby bench's workload: DDP over gloo, a step every --step-seconds, until the bench stops it.

Stamps (CLOCK_MONOTONIC, shared by every process on the machine) go to ``--out``, each named
``<what>.rank_<R>.group_<G>.pid_<P>.node_<N>`` (G: GROUP_RANK, the rank's position; N: the bench's
BENCH_NODE, set per launcher: which launcher ran it) and holding the time. ``warm``: the rank
finished step --warm-at; ``first_step``: this process finished its first step. The bench ends the
job by creating ``<out>/stop``; the ranks agree on it in an all-reduce, so all leave at the same
step and every launcher exits 0. No fault of its own: the bench kills a node from outside.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

NODE_ENV = "BENCH_NODE"


def stamp(out: Path, what: str, rank: int) -> None:
    where = f"group_{os.environ['GROUP_RANK']}.pid_{os.getpid()}.node_{os.environ[NODE_ENV]}"
    name = f"{what}.rank_{rank}.{where}"
    (out / f"{name}.tmp").write_text(repr(time.monotonic()))
    (out / f"{name}.tmp").rename(out / name)


def stop_asked(out: Path) -> bool:
    """True on every rank once any rank saw ``<out>/stop``: one agreed step to leave at."""
    flag = torch.tensor([1.0 if (out / "stop").exists() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warm-at", type=int, default=20, help="the step after which the bench may kill")
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU()))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    step = 0
    while not stop_asked(args.out):
        loss = net(torch.randn(16, args.width)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            stamp(args.out, "first_step", rank)
        if step == args.warm_at:
            stamp(args.out, "warm", rank)
        step += 1
        time.sleep(args.step_seconds)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see examples/train.py: skip gloo's racy interpreter-shutdown path


if __name__ == "__main__":
    main()
