"""The GPU restart benchmark's workload (one rank): DDP over NCCL (gloo with ``--device cpu``), a
stack of 2048² linear layers sized to ``--state-mb`` of weights + AdamW state, a storage checkpoint
every ``--save-every`` steps (blocking: committed before the crash, so torchrun resumes from it)
and, with ``--memory``, a memory-tier snapshot after every step. The rank SIGKILLs itself half-way
through step ``--crash-at`` (after its backward), once.

Stamps (CLOCK_MONOTONIC, one file each, the same clock in every process) go to ``--out``:
``death``; then for each attempt ``a<N>.started`` (the script's first line: before it imports
anything but the standard library), ``a<N>.imported`` (torch and worker_lib imported),
``a<N>.ready`` (the process group made, the device's CUDA context in use), ``a<N>.built`` (model
and optimizer built on the device, as a GPU script builds them: in place, not on the CPU first),
``a<N>.restored`` (the checkpoint loaded into them), ``a<N>.loaded`` (DDP built),
``a<N>.step_<S>`` (step S done, the device synchronized) and ``a<N>.resumed_at`` (the step it
resumed from).
"""

import time  # noqa: I001 - first: the stamp below is the process's first moment as a script

STARTED = time.monotonic()

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

WIDTH = 2048
BYTES_PER_PARAM = 12  # fp32 weight + AdamW's two moments


def stamp(out: Path, name: str, value: float) -> None:
    (out / f"{name}.tmp").write_text(repr(value))
    (out / f"{name}.tmp").rename(out / name)


def wait_for_slots_mapped_by_another(rank: int, timeout: float = 60.0) -> None:
    """Until a process other than this one maps both of this rank's slots (/proc/PID/maps)."""
    folder = os.environ["FTLAUNCH_MEMORY_DIR"]
    wanted = [f"{folder}/rank_{rank}.{slot}" for slot in (0, 1)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            if all(path in maps for path in wanted):
                return
        time.sleep(0.05)
    raise SystemExit(f"no warm spare mapped {wanted} within {timeout:g} s")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--state-mb", type=float, default=400)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--memory", action="store_true", help="a memory-tier snapshot after every step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=12)
    p.add_argument("--steps-after", type=int, default=2, help="steps run past the crash step, then exit")
    p.add_argument(
        "--crash-when-spared",
        action="store_true",
        help="before the crash, wait until the warm spare maps both memory-tier slots (it is warm and "
        "has registered them): the steady state, not a crash in the first seconds of an attempt",
    )
    return p.parse_args()


def main() -> None:
    args = parse()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stamp(args.out, f"a{attempt}.started", STARTED)

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import worker_lib as ft

    stamp(args.out, f"a{attempt}.imported", time.monotonic())
    info = ft.init(checkpoint_dir=args.checkpoint_dir)
    device = torch.device(info.device if args.device == "cuda" else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    stamp(args.out, f"a{attempt}.ready", time.monotonic())

    layers = max(1, round(args.state_mb * 1e6 / (BYTES_PER_PARAM * WIDTH * WIDTH)))
    torch.manual_seed(0)
    with device:
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync()
    stamp(args.out, f"a{attempt}.built", time.monotonic())
    ckpt = ft.load_checkpoint()
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start = ckpt.step
    sync()
    stamp(args.out, f"a{attempt}.restored", time.monotonic())
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sync()
    stamp(args.out, f"a{attempt}.loaded", time.monotonic())
    stamp(args.out, f"a{attempt}.resumed_at", start)

    for step in range(start, args.crash_at + args.steps_after + 1):
        x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(step)).to(device)
        loss = ddp(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        if step == args.crash_at and attempt == 0:
            if args.crash_when_spared:
                ft.wait_for_checkpoint()
                wait_for_slots_mapped_by_another(info.rank)
            sync()
            stamp(args.out, "death", time.monotonic())
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        sync()
        stamp(args.out, f"a{attempt}.step_{step}", time.monotonic())
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if args.memory:
            ft.save_checkpoint(step + 1, state, to="memory")
        if (step + 1) % args.save_every == 0:
            ft.save_checkpoint(step + 1, state, blocking=True)
    ft.shutdown()
    os._exit(0)  # see examples/train.py: skip gloo's racy interpreter shutdown


if __name__ == "__main__":
    main()
