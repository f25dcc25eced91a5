"""DDP training through worker_lib's checkpoints, with crashes injected where a test asks.

Deterministic given its arguments: the data of each step depends on (step, rank) only, and the
label noise is drawn from the global torch RNG, so a resumed run matches a run that never
stopped only if worker_lib restored the model, the optimizer *and* the RNG states.
"""

import argparse
import io
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from until import add_option, steps

import worker_lib as ft
from worker_lib.checkpoint.commit import Commits
from worker_lib.core.storage import Storage


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument(
        "--crash", action="append", default=[], help="STEP:ATTEMPT: rank --crash-rank is SIGKILLed"
    )
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument(
        "--crash-after-backward",
        action="store_true",
        help="the crash comes after the step's backward: every rank is in that step, so every rank "
        "finished what came before it (a crash at the step's start can kill a peer still in the last one)",
    )
    p.add_argument("--die-before-commit", type=int, help="rank 0 dies after its part, before the marker")
    p.add_argument("--die-mid-write", type=int, help="rank 1 dies half-way through writing its part")
    p.add_argument("--replicated", action="store_true")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    p.add_argument("--stop-aware", action="store_true", help="save and leave at ft.should_stop's step")
    p.add_argument("--memory-every", type=int, default=0, help="steps between memory snapshots (0: none)")
    p.add_argument("--die-mid-snapshot", type=int, help="rank 1 dies half-way through this memory snapshot")
    p.add_argument(
        "--die-in-snapshot",
        help="STEP:MOMENT: rank 1 dies at MOMENT of its snapshot's background part (after save returned), "
        "once rank 0 holds STEP",
    )
    p.add_argument(
        "--bad-node-step", type=int, help="with BAD_NODE=1 in its environment, a rank dies this many steps in"
    )
    p.add_argument(
        "--fixed-buckets",
        action="store_true",
        help="DDP never rebuilds its buckets (find_unused_parameters=True), so a restart's first steps "
        "sum each gradient in the order the clean run does: bit-identical with 3 or more ranks",
    )
    p.add_argument("--out", required=True)
    add_option(p)
    return p.parse_args()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject_storage_faults(args, rank: int, attempt: int) -> None:
    """Replace pieces of worker_lib with versions that die at the chosen moment (first attempt)."""
    if attempt != 0:
        return
    if args.die_before_commit is not None and rank == 0:
        commit = Commits._write_marker

        def commit_or_die(self, step, *rest):
            if step == args.die_before_commit:
                print(f"rank 0: dying before the commit of step {step}", flush=True)
                die()
            commit(self, step, *rest)

        Commits._write_marker = commit_or_die
    if args.die_mid_write is not None and rank == 1:
        write = Storage.write_stream

        def write_half_or_die(self, rel, fill, retries=True):
            if rel.startswith(f"step_{args.die_mid_write}/"):
                print(f"rank 1: dying half-way through {rel}", flush=True)
                whole = io.BytesIO()
                fill(whole)
                data = whole.getvalue()
                self.fs.pipe_file(self.path(rel), data[: len(data) // 2])  # a torn, non-atomic write
                die()
            return write(self, rel, fill, retries)

        Storage.write_stream = write_half_or_die
    if args.die_mid_snapshot is not None and rank == 1:
        import worker_lib.checkpoint.memory as memory

        fill = memory._fill

        def fill_half_or_die(tensors, views):
            if memory_step[0] == args.die_mid_snapshot:
                print(
                    f"rank 1: dying half-way through its memory snapshot of step {memory_step[0]}", flush=True
                )
                half = len(tensors) // 2
                fill(tensors[:half], views[:half])
                die()
            return fill(tensors, views)

        memory._fill = fill_half_or_die
    if args.die_in_snapshot is not None and rank == 1:
        _die_in_snapshot(*args.die_in_snapshot.split(":"))


def _die_in_snapshot(step: str, moment: str) -> None:
    """Rank 1 is SIGKILLed at ``moment`` of the background part of its snapshot of ``step``, once
    rank 0's record of that step is written (so what loads depends on rank 1's slot alone)."""
    import worker_lib.checkpoint.memory as memory

    def die_there(name: str, at: int) -> None:
        if name != moment or at != int(step):
            return
        records = [memory.memory_folder() / f"rank_0.{slot}.json" for slot in (0, 1)]
        deadline = time.monotonic() + 60
        while not any(_record_step(p) == at for p in records):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank 0 never held step {at}")
            time.sleep(0.01)
        print(f"rank 1: dying at {name!r} of its memory snapshot of step {at}", flush=True)
        die()

    memory._moment = die_there


def _record_step(path) -> int:
    """The step of a slot's record; -1 while there is none (or it is being replaced)."""
    import json

    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


memory_step = [0]  # the memory snapshot being taken, for --die-mid-snapshot


def main() -> None:
    args = parse()
    info = ft.init()
    inject_storage_faults(args, info.rank, info.attempt)
    crashes = {tuple(map(int, c.split(":"))) for c in args.crash}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = ft.load_checkpoint()
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start = ckpt.step
    print(f"rank {info.rank} attempt {info.attempt} starts at step {start}", flush=True)
    print(f"rank {info.rank} attempt {info.attempt} has WORLD_SIZE {os.environ['WORLD_SIZE']}", flush=True)
    ddp = DDP(model, find_unused_parameters=args.fixed_buckets)
    for step in steps(start, args.steps, info.attempt, args.until_attempt):
        crash = (step, info.attempt) in crashes and info.rank == args.crash_rank
        if (
            args.bad_node_step is not None
            and os.environ.get("BAD_NODE") == "1"
            and step == start + args.bad_node_step
        ):
            print(f"rank {info.rank}: dies on a bad node at step {step}", flush=True)
            die()  # a failing GPU: every attempt that runs here
        if crash and not args.crash_after_backward:
            print(f"rank {info.rank}: crash at step {step}", flush=True)
            die()
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 1000 + info.rank))
        y = x[:, :4] + 0.1 * torch.randn(16, 4)  # global RNG: must be restored on resume
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        if crash:  # after the all-reduce: every peer took its snapshot of this step's start
            print(f"rank {info.rank}: crash at step {step}", flush=True)
            die()
        optimizer.step()
        time.sleep(args.step_time)
        ft.heartbeat(step + 1)  # steps done: what --chaos at=step: and the hang monitor read
        if args.memory_every and (step + 1) % args.memory_every == 0:
            memory_step[0] = step + 1
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            ft.save_checkpoint(step + 1, state, to="memory")
        stop = args.stop_aware and ft.should_stop(step + 1)
        if (step + 1) % args.save_every == 0 or stop:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            ft.save_checkpoint(step + 1, state, metrics={"loss": loss.item()}, replicated=args.replicated)
        if stop:
            print(f"rank {info.rank} attempt {info.attempt} stops at step {step + 1}", flush=True)
            ft.wait_for_checkpoint()
            os._exit(0)
    ft.wait_for_checkpoint()
    if info.rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see examples/train.py: skip gloo's racy interpreter shutdown


if __name__ == "__main__":
    main()
