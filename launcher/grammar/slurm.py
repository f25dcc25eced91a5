"""What a SLURM job step tells ftlaunch: how many nodes, which one this is, where node 0 is, and
the job's id (stable across requeues). Read from SLURM's environment, never guessed."""

import dataclasses
import itertools
import math
import re
from typing import List, Mapping, Optional

from launcher.grammar.errors import UsageError
from launcher.grammar.numbers import digits, whole_number

__all__ = ["SlurmStep", "expand_hostlist", "read_slurm_step"]

# torchrun's default rendezvous port is 29400; a job on a shared node gets its own.
_BASE_PORT = 29400
_PORT_SPREAD = 1000
# Far beyond any cluster's: a list that names more is a mistake, expanded it would fill memory.
_MOST_HOSTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    job_id: str
    nnodes: int
    node_rank: int
    first_host: str  # node 0: it hosts the job's store (the node list's first, as read here)
    nodelist: str = ""  # as SLURM wrote it; ``launcher.cli.discover`` asks scontrol to name node 0

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.first_host}:{_BASE_PORT + int(self.job_id) % _PORT_SPREAD}"


def read_slurm_step(environ: Mapping[str, str]) -> Optional[SlurmStep]:
    """The srun step this process is a task of, or None outside one. A batch script's own shell
    is no step (it has no SLURM_STEP_NUM_NODES): ftlaunch run there is one node, as without SLURM."""
    if "SLURM_JOB_ID" not in environ or "SLURM_STEP_NUM_NODES" not in environ:
        return None
    try:
        job_id = environ["SLURM_JOB_ID"]
        nnodes = whole_number(environ["SLURM_STEP_NUM_NODES"])
        tasks = whole_number(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", str(nnodes))))
        task = whole_number(environ.get("SLURM_PROCID", "0"))
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
        whole_number(job_id)
    except (KeyError, ValueError) as err:
        raise UsageError(f"cannot read this SLURM step's environment: {err}") from None
    if tasks != nnodes:
        raise UsageError(
            f"this SLURM step runs {tasks} tasks on {nnodes} node(s); ftlaunch runs once per node and "
            "starts the workers itself: srun --ntasks-per-node=1 ftlaunch --nproc N ..."
        )
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise UsageError(f"SLURM's node list is empty: {nodelist!r}")
    return SlurmStep(job_id, nnodes, task, first_host=hosts[0], nodelist=nodelist)


def expand_hostlist(nodelist: str) -> List[str]:
    """SLURM's compressed host list: ``gpu[001-003,010],cpu7`` → gpu001 gpu002 gpu003 gpu010 cpu7;
    several bracket groups in one name multiply (``r[1-2]n[1-2]`` → r1n1 r1n2 r2n1 r2n2)."""
    hosts: List[str] = []
    for name in _split_top_level(nodelist):
        parts = re.split(r"(\[[^\]]*\])", name)
        choices = [_expand_range(p[1:-1]) if p.startswith("[") else [p] for p in parts]
        if len(hosts) + math.prod(len(c) for c in choices) > _MOST_HOSTS:
            raise UsageError(f"SLURM's node list names more than {_MOST_HOSTS} hosts: {nodelist[:80]!r}")
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _split_top_level(text: str) -> List[str]:
    """Split at commas outside brackets."""
    names, depth, current = [], 0, ""
    for ch in text.strip():
        if ch == "," and depth == 0:
            names.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise UsageError(f"cannot read SLURM's node list {text!r}")
        current += ch
    if depth:
        raise UsageError(f"cannot read SLURM's node list {text!r}")
    names.append(current)
    return [n for n in names if n]


def _expand_range(spec: str) -> List[str]:
    """``001-003,010`` → 001 002 003 010: zero padding kept, as SLURM writes it."""
    out = []
    for item in spec.split(","):
        low, _, high = item.partition("-")
        if not digits(low) or (high and not digits(high)):
            raise UsageError(f"cannot read the range [{spec}] in SLURM's node list")
        if not high:
            out.append(low)
            continue
        if int(high) < int(low):
            raise UsageError(f"cannot read the range [{spec}] in SLURM's node list")
        if int(high) - int(low) >= _MOST_HOSTS:
            raise UsageError(f"the range [{spec}] in SLURM's node list names more than {_MOST_HOSTS} hosts")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out
