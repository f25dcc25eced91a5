"""Plan, then execute: what each rank of an attempt runs, as plain data that tests can inspect."""

import dataclasses
import os
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

from launcher.core.config import EntrySection, GroupSection
from launcher.core.layout import Layout
from worker_lib.core import contract as c

__all__ = ["WorkerPlan", "WorkerSpec", "attempt_dir", "plan_workers", "worker_env"]

# The flight recorder's entries (its ring; torch's default is off): enough for the last steps'
# collectives of a DDP job; a dump of 512 takes ~10 ms, read every few seconds (own_work.py).
FR_ENTRIES = "512"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    argv: Tuple[str, ...]
    env: Mapping[str, str]
    log_file: Path
    error_file: Path


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """What this node's ranks run in every attempt, and what their environment says of the job."""

    entry: EntrySection
    group: GroupSection
    run_id: str
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS: --max-failures
    every_node: Layout  # the ranks this node runs when every node of the job is present
    chaos: bool = False  # --chaos: the ranks look for injected faults


def attempt_dir(log_dir: Path, attempt: int) -> Path:
    return log_dir / f"attempt_{attempt}"


def plan_workers(
    plan: WorkerPlan,
    attempt: int,
    master_port: int,
    base_env: Optional[Mapping[str, str]] = None,
    heartbeat_file: Optional[Path] = None,
    master_addr: Optional[str] = None,
    layout: Optional[Layout] = None,
    memory_dir: Optional[Path] = None,
) -> List[WorkerSpec]:
    """One spec per local rank; ``base_env`` (default: ours) is what the workers inherit;
    ``master_addr`` (default: --master-addr) is where the workers' store listens; ``layout``
    (default: every node of the job) which ranks this node runs; ``memory_dir``: the node's
    memory tier (None: none)."""
    layout = layout or plan.every_node
    base = dict(os.environ if base_env is None else base_env)
    folder = attempt_dir(plan.group.log_dir, attempt)
    argv = plan.entry.worker_argv()
    specs = []
    for local_rank in range(plan.group.nproc):
        rank = layout.rank(local_rank)
        error_file = folder / f"rank_{rank}.error.json"
        env = worker_env(plan, layout, local_rank, attempt, master_port, error_file, base)
        if master_addr is not None:
            env[c.MASTER_ADDR] = master_addr
        if heartbeat_file is not None:
            env[c.FT_HEARTBEAT_FILE] = str(heartbeat_file)
        env.pop(c.FT_MEMORY_DIR, None)  # only this supervisor's folder, never one inherited
        if memory_dir is not None:
            env[c.FT_MEMORY_DIR] = str(memory_dir)
        specs.append(
            WorkerSpec(
                rank=rank,
                local_rank=local_rank,
                argv=argv,
                env=env,
                log_file=folder / f"rank_{rank}.log",
                error_file=error_file,
            )
        )
    return specs


def worker_env(
    plan: WorkerPlan,
    layout: Layout,
    local_rank: int,
    attempt: int,
    master_port: int,
    error_file: Path,
    base: Mapping[str, str],
) -> dict:
    """torchrun's variables with torchrun's meaning, plus ftlaunch's own."""
    env = dict(base)
    rank = layout.rank(local_rank)
    env.update(
        {
            c.RANK: str(rank),
            c.LOCAL_RANK: str(local_rank),
            c.WORLD_SIZE: str(layout.world_size),
            c.LOCAL_WORLD_SIZE: str(plan.group.nproc),
            c.GROUP_RANK: str(layout.group_rank),
            c.GROUP_WORLD_SIZE: str(layout.group_world_size),
            c.ROLE_RANK: str(rank),
            c.ROLE_NAME: "default",
            c.ROLE_WORLD_SIZE: str(layout.world_size),
            c.MASTER_ADDR: plan.group.master_addr,
            c.MASTER_PORT: str(master_port),
            c.RESTART_COUNT: str(attempt),
            c.MAX_RESTARTS: str(plan.max_restarts),
            c.RUN_ID: plan.run_id,
            c.USE_AGENT_STORE: "True",
            c.ERROR_FILE: str(error_file.resolve()),
            c.NCCL_ASYNC_ERROR_HANDLING: base.get(c.NCCL_ASYNC_ERROR_HANDLING, "1"),
            # torch's flight recorder: each rank's own work is read from it (stragglers)
            c.FR_BUFFER_SIZE: base.get(c.FR_BUFFER_SIZE, FR_ENTRIES),
            c.FT_ATTEMPT: str(attempt),
            c.FT_BACKEND: plan.group.backend,
        }
    )
    if plan.group.checkpoint_url:
        env[c.FT_CHECKPOINT_URL] = plan.group.checkpoint_url
    if plan.chaos:
        env[c.FT_CHAOS] = "1"
    if plan.group.nproc > 1 and "OMP_NUM_THREADS" not in base:
        # As torchrun does: N ranks each using every core oversubscribe the CPU badly.
        env["OMP_NUM_THREADS"] = "1"
    return env
