"""LaunchConfig: built once by the CLI, validated, frozen, passed down in sections
(``launcher.cli.preflight`` checks it against the world)."""

import dataclasses
import enum
import hashlib
import json
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, FrozenSet, Optional, Sequence, Tuple

from launcher.core.policy import RestartPolicy
from launcher.grammar.chaos import ChaosPlan
from launcher.grammar.errors import UsageError
from launcher.grammar.numbers import digits

__all__ = [
    "ChaosSection",
    "ClusterSection",
    "CopySection",
    "EntryKind",
    "EntrySection",
    "GroupSection",
    "HangSection",
    "HealthSection",
    "LaunchConfig",
    "MetricsSection",
    "RunSection",
    "default_run_name",
    "join_run_url",
]


class EntryKind(str, enum.Enum):
    """How the entry point is run: ``python SCRIPT``, ``python -m MODULE`` or ``SCRIPT`` itself."""

    SCRIPT = "script"
    MODULE = "module"
    EXECUTABLE = "executable"  # --no-python


def _number(text: str) -> float:
    """A number of seconds from --rdzv-conf; 0 for anything else (torch's handler says what is wrong
    with it)."""
    try:
        return float(text)
    except ValueError:
        return 0.0


def _finite(value: Optional[float], option: str) -> None:
    if value is not None and not math.isfinite(value):  # nan compares false with everything
        raise UsageError(f"{option} must be a finite number of seconds, got {value}")


@dataclasses.dataclass(frozen=True)
class EntrySection:
    """What every rank runs: ``python SCRIPT``, ``python -m MODULE`` or ``SCRIPT`` itself."""

    entrypoint: str
    script_args: Tuple[str, ...] = ()
    kind: EntryKind = EntryKind.SCRIPT
    python: str = sys.executable

    @property
    def command(self) -> Tuple[str, ...]:
        """What makes a run this run: how and what it runs, with which arguments."""
        return (self.kind.value, self.entrypoint, *self.script_args)

    @property
    def default_run_name(self) -> str:
        return default_run_name(self.kind, self.entrypoint, self.script_args)

    def worker_argv(self) -> Tuple[str, ...]:
        """The command line every rank runs."""
        if self.kind is EntryKind.MODULE:
            return (self.python, "-u", "-m", self.entrypoint, *self.script_args)
        if self.kind is EntryKind.EXECUTABLE:
            return (self.entrypoint, *self.script_args)
        return (self.python, "-u", self.entrypoint, *self.script_args)


@dataclasses.dataclass(frozen=True)
class GroupSection:
    """This node's worker group: how many, how they are started, stopped and heard."""

    nproc: int = 1
    backend: str = "gloo"  # resolved: "nccl" or "gloo", never "auto"
    log_dir: Path = Path("ftlaunch_logs")
    grace_period: float = 5.0  # seconds between SIGTERM and SIGKILL
    fork_server: bool = True  # fork workers from a process that has imported torch (not --no-python)
    preload: Tuple[str, ...] = ()  # more modules for the fork server to import, shared by every worker
    warm_spare: bool = False  # a process per local rank forked ahead, CUDA context made (nccl)
    preempt_signal: int = int(signal.SIGUSR1)  # means what SIGTERM means; workers start with it ignored
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the OS picks a free port for each attempt's store
    console_ranks: Optional[FrozenSet[int]] = None  # None: every rank on the console
    checkpoint_url: Optional[str] = None  # fsspec URL handed to workers (worker_lib's storage root)

    def __post_init__(self) -> None:
        _finite(self.grace_period, "--grace-period")
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        if self.backend not in ("nccl", "gloo"):
            raise UsageError(f"backend must be resolved to nccl or gloo, got {self.backend!r}")
        if self.grace_period < 0:
            raise UsageError(f"--grace-period must be 0 or more seconds, got {self.grace_period}")
        if not 0 <= self.master_port < 65536:
            raise UsageError(f"--master-port must be in 0..65535, got {self.master_port}")
        bad = [name for name in self.preload if not all(part.isidentifier() for part in name.split("."))]
        if bad:
            raise UsageError(f"--preload takes module names (a.b,c), got {bad[0]!r}")
        for wanted, option in ((self.preload, "--preload"), (self.warm_spare, "--warm-spare on")):
            if wanted and not self.fork_server:
                raise UsageError(f"{option} needs the fork server: not with --no-fork-server or --no-python")

    def shows_on_console(self, rank: int) -> bool:
        return self.console_ranks is None or rank in self.console_ranks


@dataclasses.dataclass(frozen=True)
class HangSection:
    """When silence is a hang (``launcher.hangs``)."""

    init_timeout: float = 900.0  # seconds from start (or a pause) to a beat, once the script beats
    heartbeat_timeout: Optional[float] = None  # seconds between beats; None: auto; 0: off
    heartbeat_floor: float = 120.0  # the smallest deadline auto sets
    progress_timeout: Optional[float] = None  # seconds a rank may beat without a new step; None: off
    # A rank whose own work is this many times the median of the others' is named slow; None: off.
    straggler_factor: Optional[float] = 1.5
    straggler_window: float = 30.0  # seconds each rank's own work is averaged over

    def __post_init__(self) -> None:
        _finite(self.straggler_factor, "--straggler-factor")
        if self.straggler_factor is not None and not 1 < self.straggler_factor <= 1000:
            raise UsageError(
                f"--straggler-factor must be more than 1 and at most 1000, got {self.straggler_factor:g}"
            )
        _finite(self.straggler_window, "--straggler-window")
        if not 1 <= self.straggler_window <= MAX_CLUSTER_WAIT_S:
            raise UsageError(f"--straggler-window must be 1 s to 7d, got {self.straggler_window:g} s")
        _finite(self.init_timeout, "--init-timeout")
        _finite(self.heartbeat_timeout, "--heartbeat-timeout")
        _finite(self.heartbeat_floor, "--heartbeat-floor")
        _finite(self.progress_timeout, "--progress-timeout")
        if self.progress_timeout is not None and self.progress_timeout <= 0:
            raise UsageError(f"--progress-timeout must be more than 0 seconds, got {self.progress_timeout}")
        if self.init_timeout <= 0 or self.heartbeat_floor <= 0:
            raise UsageError("--init-timeout and --heartbeat-floor must be more than 0 seconds")
        if self.heartbeat_timeout is not None and self.heartbeat_timeout < 0:
            raise UsageError(
                f"--heartbeat-timeout must be auto, off or seconds, got {self.heartbeat_timeout}"
            )

    @property
    def detects(self) -> bool:
        return self.heartbeat_timeout != 0


@dataclasses.dataclass(frozen=True)
class RunSection:
    """The run directory that holds the run (``launcher.runs``)."""

    url: str = "ftlaunch_runs/run"  # fsspec URL of the run directory: <--run-dir>/<--run-name>
    name: str = "run"
    run_id: str = "ftlaunch"  # TORCHELASTIC_RUN_ID, and the rendezvous' id unless --rdzv-id
    fresh: bool = False  # archive a finished run and start it again
    lease: float = 60.0  # seconds the run lock lasts without renewal
    storage_timeout: float = 20.0  # seconds the storage probes before start may take

    def __post_init__(self) -> None:
        _finite(self.lease, "--lease")
        _finite(self.storage_timeout, "--storage-timeout")
        _check_folder_names(self.name, self.run_id)
        if not 0 < self.lease <= _LONGEST_LEASE_S:
            raise UsageError(f"--lease must be more than 0 seconds and at most 7d, got {self.lease:g} s")
        if self.storage_timeout <= 0:
            raise UsageError(f"--storage-timeout must be more than 0 seconds, got {self.storage_timeout}")


# A lease beyond a week is no lease: its lock would outlive any host that could renew it (1e300
# was taken, and printed a 300-digit age to the next launch).
_LONGEST_LEASE_S = 7 * 86400.0

# The most bytes a file or folder name may have (NAME_MAX on Linux's filesystems: ext4, xfs, tmpfs).
NAME_MAX = 255


def _folders_named(name: str, run_id: str) -> Tuple[Tuple[str, str, str], ...]:
    """The folders whose whole name is the run's name or id: (option, folder, its name). All else
    ftlaunch and worker_lib make lies below them under names of their own (run.json,
    checkpoints/step_<n>, logs/attempt_<n>); /dev/shm's memory tier and heartbeat files are named
    by pid, and no socket has a path."""
    return (  # the id first: by default it is the name and a hash, the longer one
        ("--run-id", "the node's checkpoint cache <tmp>/ftlaunch-cache-<uid>/RUN_ID", run_id),
        ("--run-name", "the run's folder <run-dir>/NAME (or ftlaunch_logs/NAME)", name),
    )


def _check_folder_names(name: str, run_id: str) -> None:
    """Each fits a folder's name (a 250-character --run-name made a 259-byte run id: every rank
    died in ft.init with 'File name too long', a crash loop)."""
    if run_id in (".", "..") or "/" in run_id:  # '..' made ft.shutdown() remove the temp dir
        raise UsageError(
            f"--run-id must be a plain folder name (no '/', not '.' or '..'): it names the node's "
            f"checkpoint cache <tmp>/ftlaunch-cache-<uid>/RUN_ID, got {run_id!r}"
        )
    for option, folder, text in _folders_named(name, run_id):
        size = len(os.fsencode(text))
        if size <= NAME_MAX:
            continue
        if option == "--run-id" and run_id.startswith(f"{name}-"):  # derived: NAME-<hash>
            own = len(os.fsencode(name))
            raise UsageError(
                f"--run-name is {own} bytes long, at most {NAME_MAX - (size - own)}: the run id (the "
                f"name and a hash, {size} bytes) names {folder}, at most {NAME_MAX} bytes"
            )
        raise UsageError(f"{option} is {size} bytes long, at most {NAME_MAX}: it names {folder}")


# The longest --node-timeout and --join-timeout: both become torch store and rendezvous timeouts,
# which overflow past about 24 days (99999999999d was an OverflowError, exit 70). A week is far
# beyond any wait a job means.
MAX_CLUSTER_WAIT_S = 7 * 24 * 3600.0

# The most nodes a job may name (--nnodes N or MIN:MAX): far beyond today's largest jobs (2,048
# nodes of 8 GPUs), and small enough that nothing sized by it could exhaust node 0.
MAX_NODES = 16384


@dataclasses.dataclass(frozen=True)
class ClusterSection:
    """Many nodes, one ftlaunch each. Node 0 leads: it hosts the job's store at ``rdzv_endpoint``
    and the workers' store at the group's master address, holds the run, and decides for the job."""

    nnodes: int = 1  # the job's nodes; with --nnodes MIN:MAX, MAX
    min_nodes: int = 0  # --nnodes MIN:MAX's MIN (elastic membership); 0: always all nnodes
    node_rank: int = 0
    rdzv_endpoint: str = ""  # HOST:PORT of node 0's job store; "" for one node
    rdzv_id: str = ""  # the rendezvous' run id (torchrun's --rdzv-id); "" → the run id
    rdzv_conf: Tuple[Tuple[str, str], ...] = ()  # extra RendezvousParameters, as torchrun's --rdzv-conf
    join_timeout: float = 600.0  # seconds every node has to (re)join before the job gives up
    node_timeout: float = 15.0  # seconds of silence after which a node's supervisor counts as lost
    standby: int = 0  # --standby-nodes: nodes beyond nnodes (node ranks nnodes.. ) that stand by

    def __post_init__(self) -> None:
        _finite(self.join_timeout, "--join-timeout")
        _finite(self.node_timeout, "--node-timeout")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nnodes > MAX_NODES:
            raise UsageError(
                f"--nnodes {self.nnodes_given}: at most {MAX_NODES} nodes (torch's c10d rendezvous keeps "
                "every node of a round in one record that every node reads and writes)"
            )
        if not 0 <= self.min_nodes <= self.nnodes:
            raise UsageError(
                f"--nnodes {self.min_nodes}:{self.nnodes}: MIN must be at least 1 and at most MAX"
            )
        if self.standby < 0 or self.nnodes + self.standby > MAX_NODES:
            raise UsageError(
                f"--standby-nodes {self.standby}: 0 or more, and at most {MAX_NODES} nodes in all"
            )
        if self.standby and self.nnodes < 2:
            raise UsageError(
                f"--standby-nodes {self.standby} needs --nnodes 2 or more: node 0 always trains and "
                "cannot be replaced, so a standby can only take another training node's place"
            )
        if not 0 <= self.node_rank < self.members:
            also = f" (--nnodes {self.nnodes_given} + --standby-nodes {self.standby})" if self.standby else ""
            raise UsageError(f"--node-rank must be in 0..{self.members - 1}{also}, got {self.node_rank}")
        if self.join_timeout <= 0 or self.node_timeout <= 0:
            raise UsageError("--join-timeout and --node-timeout must be more than 0 seconds")
        for value, option in ((self.join_timeout, "--join-timeout"), (self.node_timeout, "--node-timeout")):
            if value > MAX_CLUSTER_WAIT_S:
                raise UsageError(f"{option} {value:g} s: at most 7 days ({MAX_CLUSTER_WAIT_S:g} s)")
        for key, setting in self.rdzv_conf:
            # torch's handler takes them as C ints and seconds; 0 keeps nodes from ever meeting
            # (no keep-alive, no beat), except for the last call (start at once with MIN).
            fewest = 0 if key == "last_call_timeout" else 1
            if not fewest <= _number(setting) <= MAX_CLUSTER_WAIT_S:
                unit = "" if key == "keep_alive_max_attempt" else " seconds (7 days)"
                raise UsageError(
                    f"--rdzv-conf {key}={setting}: must be {fewest} to {MAX_CLUSTER_WAIT_S:g}{unit}"
                )
        last_call = dict(self.rdzv_conf).get("last_call_timeout")
        if last_call is not None and _number(last_call) >= self.join_timeout:
            raise UsageError(
                f"--rdzv-conf last_call_timeout={last_call} must be shorter than --join-timeout "
                f"({self.join_timeout:g} s): a round would never start short of MAX nodes"
            )
        if self.nnodes > 1:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not digits(port) or not 0 < int(port) < 65536:
                raise UsageError(
                    f"--nnodes {self.nnodes_given} needs --rdzv-endpoint HOST:PORT (node 0's address and "
                    f"a free port), got {self.rdzv_endpoint!r}"
                )

    @property
    def many_nodes(self) -> bool:
        return self.nnodes > 1

    @property
    def members(self) -> int:
        """Every node that meets: the training nodes (at most) and the standby nodes."""
        return self.nnodes + self.standby

    @property
    def nnodes_given(self) -> str:
        """--nnodes as it was written: MIN:MAX for an elastic job, N for a fixed one."""
        return f"{self.min_nodes}:{self.nnodes}" if self.min_nodes else str(self.nnodes)

    @property
    def fewest(self) -> int:
        """The fewest nodes the job runs on."""
        return self.min_nodes or self.nnodes

    @property
    def elastic(self) -> bool:
        """Nodes may come and go: the job runs on any number from ``fewest`` to ``nnodes``."""
        return self.fewest < self.nnodes

    @property
    def leads(self) -> bool:
        """This node decides for the job: it holds the run and hosts the stores."""
        return self.node_rank == 0

    @property
    def rdzv_host(self) -> str:
        return self.rdzv_endpoint.rpartition(":")[0].strip("[]")

    @property
    def rdzv_port(self) -> int:
        return int(self.rdzv_endpoint.rpartition(":")[2])


@dataclasses.dataclass(frozen=True)
class HealthSection:
    """The node's health check before each attempt (``agent.health``): a user's command, run by
    /bin/sh -c, beside the built-in checks that always run."""

    command: str = ""  # --health-check; "": only the built-in checks
    timeout: float = 60.0  # seconds the command may take before it is killed (a failure)

    def __post_init__(self) -> None:
        _finite(self.timeout, "--health-check-timeout")
        if self.command and not self.command.strip():
            raise UsageError("--health-check must name a command, got only spaces")
        if not 0 < self.timeout <= MAX_CLUSTER_WAIT_S:
            raise UsageError(
                f"--health-check-timeout must be more than 0 seconds and at most 7d, got {self.timeout:g} s"
            )


@dataclasses.dataclass(frozen=True)
class CopySection:
    """Each node's newest memory snapshots copied to other nodes (``launcher.replicas``), so a
    node lost with its /dev/shm costs a step, not the storage interval."""

    peers: int = 1  # --memory-peers: the nodes each node's copies go to; 0: none
    rate: int = 1_000_000_000  # --memory-copy-rate: the bytes a second a node sends at most; 0: no cap

    def __post_init__(self) -> None:
        if not 0 <= self.peers < MAX_NODES:
            raise UsageError(f"--memory-peers must be 0 to {MAX_NODES - 1}, got {self.peers}")
        if self.rate < 0:
            raise UsageError(f"--memory-copy-rate must be 0 (no cap) or more bytes a second, got {self.rate}")


@dataclasses.dataclass(frozen=True)
class ChaosSection:
    plan: Optional[ChaosPlan] = None  # faults to inject into the run (--chaos); None: none


@dataclasses.dataclass(frozen=True)
class MetricsSection:
    """Where the run's metrics go (``launcher.observe``): served on a port, written to a file
    (node_exporter's textfile collector), both or neither."""

    port: Optional[int] = None  # None: no server; 0: a free port the OS picks
    addr: str = "127.0.0.1"
    file: Optional[Path] = None

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port < 65536:
            raise UsageError(f"--metrics-port must be in 0..65535, got {self.port}")
        if self.file is not None and (self.file.name == "" or self.file.is_dir()):
            raise UsageError(f"--metrics-file must name a file, got {self.file}")
        if self.file is not None and os.path.lexists(self.file) and not _regular(self.file):
            # Each write renames a new file over the path: a device (/dev/null), a FIFO or a
            # symlink there would be replaced by a regular file, for everyone.
            raise UsageError(
                f"--metrics-file must be a regular file (each write renames a new one over it), "
                f"got {self.file}, which is not"
            )


def _regular(path: Path) -> bool:
    """A regular file itself (not a link to one): what a rename may replace."""
    import stat

    return stat.S_ISREG(os.lstat(path).st_mode)


# Where each field of run.json's flat "config" record lives now: section, field.
_FLAT = {
    "entrypoint": ("entry", "entrypoint"),
    "script_args": ("entry", "script_args"),
    "entry_kind": ("entry", "kind"),
    "python": ("entry", "python"),
    **{f.name: ("group", f.name) for f in dataclasses.fields(GroupSection)},
    **{f.name: ("restart", f.name) for f in dataclasses.fields(RestartPolicy) if f.name != "count_injected"},
    **{f.name: ("hangs", f.name) for f in dataclasses.fields(HangSection)},
    "run_url": ("run", "url"),
    "run_name": ("run", "name"),
    "run_id": ("run", "run_id"),
    "fresh": ("run", "fresh"),
    "lease": ("run", "lease"),
    "storage_timeout": ("run", "storage_timeout"),
    **{f.name: ("cluster", f.name) for f in dataclasses.fields(ClusterSection)},
    "chaos": ("chaos", "plan"),
    "chaos_counts": ("restart", "count_injected"),
    "metrics_port": ("metrics", "port"),
    "metrics_addr": ("metrics", "addr"),
    "metrics_file": ("metrics", "file"),
    "health_check": ("health", "command"),
    "health_check_timeout": ("health", "timeout"),
    "memory_peers": ("copies", "peers"),
    "memory_copy_rate": ("copies", "rate"),
}
_SECTIONS = {
    "entry": EntrySection,
    "group": GroupSection,
    "restart": RestartPolicy,
    "hangs": HangSection,
    "run": RunSection,
    "cluster": ClusterSection,
    "chaos": ChaosSection,
    "metrics": MetricsSection,
    "health": HealthSection,
    "copies": CopySection,
}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything one ftlaunch run needs, in frozen sections; each component is handed the
    sections it works with. Each section checks its own values; checks across sections here."""

    entry: EntrySection
    group: GroupSection = GroupSection()
    restart: RestartPolicy = RestartPolicy()
    hangs: HangSection = HangSection()
    run: RunSection = RunSection()
    cluster: ClusterSection = ClusterSection()
    chaos: ChaosSection = ChaosSection()
    metrics: MetricsSection = MetricsSection()
    health: HealthSection = HealthSection()
    copies: CopySection = CopySection()

    def __post_init__(self) -> None:
        ranks = self.group.console_ranks
        if ranks is not None:
            outside = sorted(r for r in ranks if not 0 <= r < self.world_size)
            if outside:
                raise UsageError(f"--console-ranks names ranks {outside} outside 0..{self.world_size - 1}")
        if self.chaos.plan is not None:
            self.chaos.plan.check_ranks(self.world_size)
            self.chaos.plan.check_nodes(self.cluster.members, _nodes_given(self.cluster))
        _check_ports_apart(self.listens_on)

    @classmethod
    def of(cls, **flat: Any) -> "LaunchConfig":
        """From run.json's flat field names (``nproc=2, run_url=...``): for tests and tools."""
        parts: dict = {name: {} for name in _SECTIONS}
        for key, value in flat.items():
            section, field = _FLAT[key]
            parts[section][field] = value
        return cls(**{name: _SECTIONS[name](**fields) for name, fields in parts.items()})

    @property
    def world_size(self) -> int:
        """Every node's ranks, all nodes in (an elastic job's attempts may have fewer)."""
        return self.group.nproc * self.cluster.nnodes

    @property
    def listens_on(self) -> Tuple[Tuple[str, int], ...]:
        """The fixed ports this node's ftlaunch opens, each with the option that names it (0, the
        OS's pick, is never taken): the metrics server on every node; on the node that leads, the
        workers' store and, with many nodes, the job's store at the rendezvous endpoint."""
        ports = [("--metrics-port", self.metrics.port or 0)]
        if self.cluster.leads:
            ports.append(("--master-port", self.group.master_port))
        if self.cluster.leads and self.cluster.many_nodes:
            ports.append(("--rdzv-endpoint", self.cluster.rdzv_port))
        return tuple((option, port) for option, port in ports if port)

    @property
    def checkpoints_in_run_dir(self) -> bool:
        return self.group.checkpoint_url == f"{self.run.url}/checkpoints"

    @property
    def has_default_name(self) -> bool:
        return self.run.name == self.entry.default_run_name

    def to_json(self) -> dict:
        """The configuration as run.json records it: one flat record (the names are what
        readers of older run.json files know)."""
        data = {key: getattr(getattr(self, section), field) for key, (section, field) in _FLAT.items()}
        data["entry_kind"] = self.entry.kind.value
        data["log_dir"] = str(self.group.log_dir)
        ranks = self.group.console_ranks
        data["console_ranks"] = sorted(ranks) if ranks is not None else None
        data["script_args"] = list(self.entry.script_args)
        data["rdzv_conf"] = dict(self.cluster.rdzv_conf)
        data["chaos"] = str(self.chaos.plan) if self.chaos.plan is not None else None
        data["metrics_file"] = str(self.metrics.file) if self.metrics.file is not None else None
        return data


def _nodes_given(cluster: ClusterSection) -> str:
    standby = f" + --standby-nodes {cluster.standby}" if cluster.standby else ""
    return f"--nnodes {cluster.nnodes_given}{standby}"


def _check_ports_apart(ports: Sequence[Tuple[str, int]]) -> None:
    """Two of ftlaunch's own servers on one port: the second could never listen (it failed at the
    first attempt, after the run was written). Whatever their addresses: one port, one server."""
    seen: dict = {}
    for option, port in ports:
        if port in seen:
            raise UsageError(
                f"{seen[port]} and {option} both name port {port}: ftlaunch listens on each on this "
                "node, and each needs a port of its own"
            )
        seen[port] = option


def join_run_url(run_dir: str, name: str) -> str:
    """<run-dir>/<name>; a local run dir becomes absolute, so a relaunch from elsewhere finds it."""
    if "://" in run_dir:
        return f"{run_dir.rstrip('/')}/{name}"
    return str(Path(run_dir).expanduser().resolve() / name)


def default_run_name(kind: EntryKind, entrypoint: str, script_args: Sequence[str]) -> str:
    """The script's name and a hash of the command: the same command (run from the same place)
    finds the same run; other arguments (a sweep) make another run. Scripts are named by their
    absolute path, so a relative path names the same script only from the same directory."""
    if kind is EntryKind.MODULE:
        stem, target = entrypoint.rsplit(".", 1)[-1], entrypoint
    else:
        stem = Path(entrypoint).stem or "run"
        target = os.path.abspath(entrypoint) if kind is EntryKind.SCRIPT else entrypoint
    digest = hashlib.sha1(json.dumps([kind.value, target, *script_args]).encode()).hexdigest()
    # A run name is one path component with no spaces: "my train.py" names the run my_train-<hash>.
    stem = re.sub(r"[\s/]+", "_", stem).strip("._") or "run"
    return f"{stem}-{digest[:8]}"
