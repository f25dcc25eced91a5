"""The launch's option values (as ``options.py`` declares them) -> LaunchConfig's sections; what
they leave unsaid is derived from the machine (``discover.py``). A value it refuses is exit 2."""

import os
import secrets
import signal
import zlib
from typing import Any, FrozenSet, Mapping, Optional, Tuple

from launcher.cli.discover import place, resolve_backend, slurm_step, visible_gpu_count
from launcher.core.config import (
    ChaosSection,
    ClusterSection,
    CopySection,
    EntryKind,
    EntrySection,
    GroupSection,
    HangSection,
    HealthSection,
    LaunchConfig,
    MetricsSection,
    RunSection,
)
from launcher.core.policy import RestartPolicy
from launcher.grammar.chaos import ChaosPlan, parse_chaos
from launcher.grammar.durations import parse_duration
from launcher.grammar.errors import UsageError
from launcher.grammar.numbers import byte_rate, digits, whole_number

__all__ = ["config_from_options"]


def config_from_options(
    options: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None
) -> LaunchConfig:
    """``options``: the command's parameters as click parsed them (named as declared above);
    what they leave unsaid is derived in ``discover.place``."""
    o = options
    if o["module"] and o["no_python"]:
        raise UsageError("--module and --no-python exclude each other")
    gpus = visible_gpu_count()
    procs = _parse_nproc(o["nproc"], gpus)
    kind = EntryKind.MODULE if o["module"] else EntryKind.EXECUTABLE if o["no_python"] else EntryKind.SCRIPT
    entry = EntrySection(o["script"], tuple(o["script_args"]), kind)
    fork_server = o["fork_server"] and kind is not EntryKind.EXECUTABLE
    backend = resolve_backend(o["backend"], procs, gpus)
    at = place(
        entry,
        o["run_dir"],
        run_name=o["run_name"],
        run_id=o["run_id"],
        log_dir=o["log_dir"],
        nnodes=_parse_nnodes(o["nnodes"]) if o["nnodes"] is not None else None,
        node_rank=o["node_rank"],
        rdzv_endpoint=o["rdzv_endpoint"],
        master_addr=o["master_addr"],
        slurm=slurm_step(os.environ if environ is None else environ),
        standby=o["standby_nodes"],
    )
    return LaunchConfig(
        entry=entry,
        group=GroupSection(
            nproc=procs,
            backend=backend,
            log_dir=at.log_dir,
            grace_period=o["grace_period"],
            fork_server=fork_server,
            preload=tuple(name.strip() for name in o["preload"].split(",") if name.strip()),
            warm_spare=_warm_spare(o["warm_spare"], fork_server, backend),
            preempt_signal=int(signal.Signals[f"SIG{o['preempt_signal'].upper()}"]),
            master_addr=at.master_addr,
            master_port=o["master_port"],
            console_ranks=_parse_ranks(o["console_ranks"]),
            checkpoint_url=o["checkpoint_dir"] or f"{at.run_url}/checkpoints",
        ),
        restart=RestartPolicy(
            max_failures=o["max_failures"],
            failure_window=_duration(o, "failure_window", "--failure-window"),
            crash_loop=o["crash_loop"],
            backoff=_seconds(o, "backoff", "--backoff"),
            backoff_cap=_seconds(o, "max_backoff", "--max-backoff"),
            count_injected=o["chaos_counts"],
            max_preemptions=o["max_preemptions"],
            exclude_after=_exclude_after(o["exclude_after"], o["standby_nodes"]),
        ),
        hangs=HangSection(
            init_timeout=_seconds(o, "init_timeout", "--init-timeout"),
            heartbeat_timeout=_parse_heartbeat_timeout(o["heartbeat_timeout"]),
            heartbeat_floor=_seconds(o, "heartbeat_floor", "--heartbeat-floor"),
            progress_timeout=_duration(o, "progress_timeout", "--progress-timeout"),
            straggler_factor=_parse_factor(o["straggler_factor"]),
            straggler_window=_seconds(o, "straggler_window", "--straggler-window"),
        ),
        run=RunSection(
            url=at.run_url,
            name=at.run_name,
            run_id=at.run_id,
            fresh=o["fresh"],
            lease=_seconds(o, "lease", "--lease"),
            storage_timeout=_seconds(o, "storage_timeout", "--storage-timeout"),
        ),
        cluster=ClusterSection(
            nnodes=at.nnodes,
            min_nodes=at.min_nodes,
            node_rank=at.node_rank,
            rdzv_endpoint=at.rdzv_endpoint,
            rdzv_id=o["rdzv_id"] or "",
            rdzv_conf=_parse_rdzv_conf(o["rdzv_conf"]),
            join_timeout=_seconds(o, "join_timeout", "--join-timeout"),
            node_timeout=_seconds(o, "node_timeout", "--node-timeout"),
            standby=o["standby_nodes"],
        ),
        chaos=ChaosSection(_parse_chaos(o["chaos"], at.run_id, at.nnodes) if o["chaos"] else None),
        metrics=MetricsSection(o["metrics_port"], o["metrics_addr"], o["metrics_file"]),
        health=HealthSection(
            o["health_check"] or "", _seconds(o, "health_check_timeout", "--health-check-timeout")
        ),
        copies=CopySection(o["memory_peers"], _bytes(o, "memory_copy_rate", "--memory-copy-rate")),
    )


def _exclude_after(given: Optional[int], standby: int) -> int:
    """A bad node is excluded only where a standby can take its place: by default 2 with standby
    nodes, never without (an exclusion would only stop or shrink the job)."""
    if given is not None:
        return given
    return 2 if standby else 0


def _warm_spare(choice: str, fork_server: bool, backend: str) -> bool:
    """auto: on where the ranks have GPUs (nccl) and the fork server can make spares."""
    return choice == "on" or (choice == "auto" and fork_server and backend == "nccl")


def _duration(options: Mapping[str, Any], name: str, option: str) -> Optional[float]:
    """An option that may be left unset (None: off)."""
    value = options[name]
    return parse_duration(value, option) if value is not None else None


def _seconds(options: Mapping[str, Any], name: str, option: str) -> float:
    """An option with a default: it always has a value."""
    if options[name] is None:
        raise UsageError(f"{option} needs a duration")
    return parse_duration(options[name], option)


def _bytes(options: Mapping[str, Any], name: str, option: str) -> int:
    """A number of bytes with a unit ("500MB", "1GiB"), one line when it is not."""
    try:
        return byte_rate(options[name])
    except ValueError:
        raise UsageError(
            f"{option} must be bytes a second, e.g. 500MB or 1GiB (0: no cap), got {options[name]!r}"
        ) from None


def _parse_chaos(spec: str, run_id: str, nnodes: int) -> ChaosPlan:
    """The plan; without seed= a random seed, or on many nodes one every node derives alike."""
    seed = zlib.crc32(run_id.encode()) if nnodes > 1 else secrets.randbelow(2**31)
    return parse_chaos(spec, seed)


def _parse_heartbeat_timeout(value: str) -> Optional[float]:
    """auto: None (learned from the steps); off: 0."""
    if value.strip().lower() == "auto":
        return None
    if value.strip().lower() == "off":
        return 0.0
    return parse_duration(value, "--heartbeat-timeout")


def _parse_factor(value: str) -> Optional[float]:
    """--straggler-factor: a number, or off (None)."""
    if value.strip().lower() == "off":
        return None
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"--straggler-factor must be a number more than 1, or off, got {value!r}") from None


def _parse_nproc(value: str, gpus: int) -> int:
    """A number, or torchrun's words: auto (one per GPU, else 1), gpu, cpu (one per CPU)."""
    if value == "auto":
        return gpus or 1
    if value == "gpu":
        if not gpus:
            raise UsageError("--nproc gpu: this node sees no GPU")
        return gpus
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        return whole_number(value)
    except ValueError:
        raise UsageError(f"--nproc must be a whole number or 'auto' (or gpu, cpu), got {value!r}") from None


def _parse_nnodes(value: str) -> Tuple[int, int]:
    """N (a fixed count: MIN 0) or MIN:MAX (elastic membership)."""
    low, sep, high = value.partition(":")
    try:
        fewest, most = (whole_number(low), whole_number(high)) if sep else (0, whole_number(value))
    except ValueError:
        raise UsageError(f"--nnodes takes N or MIN:MAX (whole numbers), got {value!r}") from None
    if sep and not 1 <= fewest <= most:
        raise UsageError(f"--nnodes {value}: MIN must be at least 1 and at most MAX")
    if sep and fewest == most:  # no room to change: a fixed count
        fewest = 0
    return fewest, most


# The settings torch's c10d rendezvous handler reads (whole seconds or counts).
_RDZV_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)


def _parse_rdzv_conf(value: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    pairs = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        key, sep, setting = item.partition("=")
        key = key.strip()
        if not sep or key not in _RDZV_KEYS or not digits(setting.strip()):
            raise UsageError(
                f"--rdzv-conf takes {', '.join(_RDZV_KEYS)} as KEY=whole number, comma-separated, "
                f"got {item!r}"
            )
        pairs.append((key, setting.strip()))
    return tuple(pairs)


def _parse_ranks(value: Optional[str]) -> Optional[FrozenSet[int]]:
    if value is None:
        return None
    try:
        return frozenset(whole_number(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--console-ranks takes ranks like 0 or 0,3, got {value!r}") from None
