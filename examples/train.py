"""Train a small classifier on the handwritten digits data set with DDP, and survive crashes.

Plain torchrun contract only (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT via env://,
TORCHELASTIC_RESTART_COUNT): the same file runs under ``torchrun`` and under ``ftlaunch``.

    ftlaunch --nproc 2 examples/train.py --epochs 20 --crash-at-step 150

The data set (1,797 8x8 images, 10 classes) ships inside scikit-learn: no download. Rank 0
checkpoints every ``--checkpoint-every`` steps (write to a temporary file, then rename, so a
crash mid-save never destroys the last good checkpoint); after a restart every rank loads it
and continues from the same step, in the same data order.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 1234


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/digits.pt"))
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument("--crash-at-step", type=int, default=None, help="kill one rank there, first attempt only")
    p.add_argument("--crash-rank", type=int, default=1)
    return p.parse_args()


def setup() -> torch.device:
    """Join the group from torchrun's variables; nccl on GPUs, gloo on CPUs."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def load_data():
    """The same split on every rank and every attempt: a seeded permutation of the data set."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def build_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)


def save_checkpoint(path: Path, model, optimizer, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # atomic: readers see the old checkpoint or the new one, never half


def load_checkpoint(path: Path, model, optimizer, device) -> int:
    if not path.exists():
        return 0
    state = torch.load(path, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


@torch.no_grad()
def evaluate(model, data: TensorDataset, device) -> tuple:
    x, y = data.tensors[0].to(device), data.tensors[1].to(device)
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def maybe_crash(args, step: int, rank: int) -> None:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and step == args.crash_at_step and rank == args.crash_rank:
        print(f"rank {rank}: injected crash at step {step} (SIGKILL)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def train(args, device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = build_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = load_checkpoint(args.checkpoint, model, optimizer, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if step and rank == 0:
        print(f"resumed from checkpoint at step {step}", flush=True)
    steps_per_epoch, started = len(loader), time.monotonic()
    for epoch in range(step // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)  # the data order depends on the epoch only: resumes replay it
        for index, (x, y) in enumerate(loader):
            if epoch * steps_per_epoch + index < step:
                continue  # done before the restart
            maybe_crash(args, step, rank)
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint, model, optimizer, step)
        if rank == 0:
            test_loss, acc = evaluate(model, test_set, device)
            print(
                f"epoch {epoch + 1}/{args.epochs} step {step} train loss {loss.item():.4f} "
                f"test loss {test_loss:.4f} accuracy {acc:.3f}",
                flush=True,
            )
    if rank == 0:
        test_loss, acc = evaluate(model, test_set, device)
        print(
            f"final: step {step}, test loss {test_loss:.4f}, test accuracy {acc:.3f} "
            f"({time.monotonic() - started:.1f}s in this attempt)",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    device = setup()
    train(args, device)
    dist.barrier()  # no rank tears down while a peer is still in its last collective
    dist.destroy_process_group()
    # torch 2.13's gloo worker threads may free their last work item during interpreter
    # shutdown, which aborts the process (SIGABRT, "terminate called without an active
    # exception"; under torchrun too, in about one run in three without the barrier). Our work
    # is saved and flushed: leave without running the interpreter's finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
