"""What the command line learns from the world before it builds the configuration: the GPUs this
node sees, the backend they allow, and where this node sits among the others (flags first, then
SLURM's environment, where ``scontrol`` names node 0's host)."""

import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Tuple

from launcher.core.config import EntrySection, join_run_url
from launcher.grammar.errors import UsageError
from launcher.grammar.slurm import SlurmStep, read_slurm_step
from worker_lib.core.backend import choose_backend

__all__ = ["Placement", "place", "resolve_backend", "slurm_step", "visible_gpu_count"]


def slurm_step(environ: Mapping[str, str]) -> Optional[SlurmStep]:
    """The srun step this process is a task of (None outside one), its node 0 named as
    ``scontrol show hostnames`` names it where scontrol exists."""
    step = read_slurm_step(environ)
    if step is None or not shutil.which("scontrol"):
        return step
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", step.nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return step  # our own reading of the node list stands
    if out.returncode == 0 and out.stdout.split():
        return dataclasses.replace(step, first_host=out.stdout.split()[0])
    return step


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the options left unsaid, derived: which run this is, where its logs go, and how this
    node joins the others (from SLURM's environment under srun)."""

    run_name: str
    run_url: str
    run_id: str
    log_dir: Path
    nnodes: int
    min_nodes: int  # --nnodes MIN:MAX's MIN; 0: fixed
    node_rank: int
    rdzv_endpoint: str  # "" for one node
    master_addr: str


def place(
    entry: EntrySection,
    run_dir: str,
    run_name: Optional[str] = None,
    run_id: Optional[str] = None,
    log_dir: Optional[Path] = None,
    nnodes: Optional[Tuple[int, int]] = None,
    node_rank: Optional[int] = None,
    rdzv_endpoint: Optional[str] = None,
    master_addr: Optional[str] = None,
    slurm: Optional[SlurmStep] = None,
    standby: int = 0,
) -> Placement:
    """Each argument left None is derived; flags always win over SLURM's environment.
    ``nnodes``: (MIN, MAX), MIN 0 for a fixed count; under srun, the step's nodes less the
    ``standby`` nodes (--standby-nodes)."""
    fewest, nodes = nnodes if nnodes is not None else (0, _slurm_nodes(slurm, standby))
    many = nodes + standby > 1
    if node_rank is None:
        node_rank = slurm.node_rank if slurm and many else 0
    if rdzv_endpoint is None:
        rdzv_endpoint = slurm.rdzv_endpoint if slurm and many else ""
    rdzv_endpoint = with_default_port(rdzv_endpoint)
    if run_name is None and slurm is not None:  # the job id survives requeues; the command may not
        run_name = f"{entry.default_run_name.rsplit('-', 1)[0]}-job{slurm.job_id}"
    name = _check_run_name(entry.default_run_name if run_name is None else run_name)
    run_url = join_run_url(run_dir, name)
    local = "://" not in run_url or run_url.startswith("file://")
    run_id = run_id or f"{name}-{hashlib.sha1(run_url.encode()).hexdigest()[:8]}"
    if log_dir is None:  # logs are written by this node: on the run dir only when it is local
        log_dir = Path(run_url.replace("file://", "")) / "logs" if local else Path("ftlaunch_logs") / name
    if many:  # each node's logs and events under its own name
        log_dir = log_dir / f"node{node_rank}"
    if master_addr is None:
        master_addr = rdzv_endpoint.rpartition(":")[0].strip("[]") if many else "127.0.0.1"
    endpoint = rdzv_endpoint if many else ""
    return Placement(name, run_url, run_id, log_dir, nodes, fewest, node_rank, endpoint, master_addr)


def _slurm_nodes(slurm: Optional[SlurmStep], standby: int) -> int:
    """--nnodes left out: the srun step's nodes, less the standby nodes among them."""
    if slurm is None:
        return 1
    if slurm.nnodes - standby < 1:
        raise UsageError(
            f"--standby-nodes {standby} leaves no training node of the step's {slurm.nnodes} node(s) "
            "(SLURM_NNODES): allocate --nnodes plus the standby nodes"
        )
    return slurm.nnodes - standby


# torchrun's c10d rendezvous listens here when --rdzv-endpoint names only a host
# (torch.distributed.elastic.rendezvous.c10d_rendezvous_backend's default).
DEFAULT_RDZV_PORT = 29400


def with_default_port(endpoint: str) -> str:
    """``endpoint`` with torchrun's default port when it names only a host ("10.0.0.1",
    "node0", "[fe80::1]"), as torchrun reads it; else as given (checked later)."""
    host = endpoint.strip()
    if host and (host.endswith("]") or ":" not in host):
        return f"{host}:{DEFAULT_RDZV_PORT}"
    return endpoint


def _check_run_name(name: str) -> str:
    if not name:  # an unset variable in a script (--run-name "$NAME"): never the default's run
        raise UsageError("--run-name is empty: name the run, or leave the option out for the default name")
    if name in (".", "..") or "/" in name or any(ch.isspace() for ch in name):
        raise UsageError(f"--run-name must be a plain name (no '/', no spaces), got {name!r}")
    return name


# Device files a GPU driver creates (NVIDIA, ROCm, WSL's GPU bridge). With none of them there is
# no GPU to count, and the supervisor need not spend seconds importing torch to learn that.
_GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def visible_gpu_count() -> int:
    """GPUs this node can use; asks NVML through torch, so no CUDA context is created."""
    if not any(os.path.exists(path) for path in _GPU_DRIVER_FILES):
        return 0
    from launcher.process.quiet_torch import import_torch

    try:
        import_torch()
        import torch
    except ImportError:  # pragma: no cover - torch is a declared dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(requested: str, nproc: int, gpu_count: int) -> str:
    """Choose the backend and refuse nccl setups that cannot work, before anything starts."""
    try:
        backend = choose_backend(requested, gpu_count)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if backend == "nccl" and nproc > gpu_count:
        raise UsageError(f"--nproc {nproc} with nccl needs {nproc} GPUs, this node sees {gpu_count}")
    return backend
