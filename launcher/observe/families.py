"""The metrics' catalogue: each one's Prometheus name, kind and help over ``RunMetrics``'
readings, as the exporter serves them."""

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

from launcher.core.events import CheckpointTotals
from launcher.observe.metrics import RunMetrics

__all__ = ["TIERS", "Family", "families"]

TIERS = ("memory", "storage")
_UNKNOWN = math.nan

Value = Union[float, Tuple[float, float]]  # a summary's sample: (count, sum)


@dataclasses.dataclass(frozen=True)
class Family:
    """One metric and its samples, each with its own labels (beside the run's and node's)."""

    name: str
    kind: str  # "counter", "gauge" or "summary"
    help: str
    samples: Tuple[Tuple[Tuple[Tuple[str, str], ...], Value], ...]

    @classmethod
    def one(cls, name: str, kind: str, help: str, value: Value) -> "Family":
        return cls(name, kind, help, (((), value),))

    @classmethod
    def by(cls, name: str, kind: str, help: str, label: str, values: Dict[str, Value]) -> "Family":
        return cls(name, kind, help, tuple((((label, key),), value) for key, value in values.items()))


def families(metrics: RunMetrics, now: float, now_wall: float) -> List[Family]:
    """Every metric as of ``now`` (monotonic) and ``now_wall``."""
    step = metrics.newest_step
    return [
        Family.one(
            "ftlaunch_attempts",
            "counter",
            "Attempts (worker groups) started on this node.",
            metrics.attempts,
        ),
        Family.one(
            "ftlaunch_attempt",
            "gauge",
            "The newest attempt's number (-1: none yet).",
            _or(metrics.attempt, -1),
        ),
        Family.one(
            "ftlaunch_group_running",
            "gauge",
            "1 while this node's worker group runs.",
            float(metrics.running),
        ),
        Family.by(
            "ftlaunch_failures",
            "counter",
            "Failed attempts by the root cause's kind (unknown: not described).",
            "kind",
            dict(metrics.failures),
        ),
        Family.one(
            "ftlaunch_restarts",
            "counter",
            "Attempts followed by another (a failure or a resize).",
            metrics.restarts,
        ),
        Family.one(
            "ftlaunch_preemptions",
            "counter",
            "Attempts preempted (SIGTERM, the preemption signal).",
            metrics.preemptions,
        ),
        Family.one(
            "ftlaunch_resizes", "counter", "Attempts ended because the job's nodes changed.", metrics.resizes
        ),
        Family.one(
            "ftlaunch_standby_nodes",
            "gauge",
            "Standby nodes in the job's round, warm and running no rank (NaN: no --standby-nodes, or "
            "not node 0's or a follower's to tell yet).",
            metrics.standby_nodes,
        ),
        Family.one(
            "ftlaunch_replacements",
            "counter",
            "Lost nodes whose place a standby node took (node 0).",
            metrics.replacements,
        ),
        *_copy_families(metrics),
        Family.by(
            "ftlaunch_rank_own_work_ratio",
            "gauge",
            "Each rank's own work a step (its step without the wait for the others) over the median of "
            "the other ranks', over --straggler-window, where the run is held: 1 is the job's pace, 2 a "
            "rank every other one waits for. Only measured ranks have a sample.",
            "rank",
            dict(metrics.own_work),
        ),
        Family.one(
            "ftlaunch_stragglers",
            "gauge",
            "Ranks named slow now (--straggler-factor), where the run is held.",
            float(len(metrics.stragglers)),
        ),
        Family.one(
            "ftlaunch_hangs_detected", "counter", "Ranks found past their heartbeat deadline.", metrics.hangs
        ),
        Family.one("ftlaunch_chaos_injected", "counter", "Faults --chaos injected.", metrics.injected),
        Family.one(
            "ftlaunch_downtime_seconds",
            "counter",
            "Seconds from each failure to the next group's first step, summed over the recoveries.",
            metrics.downtime,
        ),
        Family.one(
            "ftlaunch_goodput_ratio",
            "gauge",
            "Share of the run's wall time spent on steps that were kept (NaN: unknown, or not "
            "this node's to tell).",
            metrics.goodput(now_wall),
        ),
        Family.one(
            "ftlaunch_step",
            "gauge",
            "The newest step every rank of this node has reported (NaN: none yet).",
            step.step if step else _UNKNOWN,
        ),
        Family.one(
            "ftlaunch_step_age_seconds",
            "gauge",
            "Seconds since the slowest rank of this node reported that step (NaN: none yet).",
            max(0.0, now - step.reported_at) if step else _UNKNOWN,
        ),
        Family.one(
            "ftlaunch_steps_per_second",
            "gauge",
            "Steps per second, this node's slowest rank (NaN: no group running, or one reading).",
            metrics.step_rate(now),
        ),
        Family.one(
            "ftlaunch_world_size",
            "gauge",
            "Ranks in the newest attempt (NaN: none yet).",
            _or(metrics.world_size),
        ),
        Family.one(
            "ftlaunch_nodes", "gauge", "Nodes in the newest attempt (NaN: none yet).", _or(metrics.nodes)
        ),
        *_checkpoint_families(metrics.checkpoint_totals),
    ]


def _checkpoint_families(totals: List[CheckpointTotals]) -> Sequence[Family]:
    """By tier, summed over each attempt's newest totals."""

    def summed(count: str, seconds: str) -> Tuple[float, float]:
        return float(sum(getattr(t, count) for t in totals)), sum(getattr(t, seconds) for t in totals)

    return [
        Family.by(
            "ftlaunch_checkpoint_save_seconds",
            "summary",
            "Checkpoint saves by this node's ranks and the seconds training waited in them, by tier.",
            "tier",
            {tier: summed(f"saves_{tier}", f"save_{tier}_s") for tier in TIERS},
        ),
        Family.one(
            "ftlaunch_checkpoint_commit_seconds",
            "summary",
            "Steps committed by this node (the job's rank 0 commits them all), and the seconds "
            "from each write to its commit.",
            summed("commits", "commit_s"),
        ),
        Family.by(
            "ftlaunch_checkpoint_load_seconds",
            "summary",
            "Checkpoint loads by this node's ranks and the seconds they took, by tier.",
            "tier",
            {tier: summed(f"loads_{tier}", f"load_{tier}_s") for tier in TIERS},
        ),
    ]


def _copy_families(metrics: RunMetrics) -> Sequence[Family]:
    """--memory-peers: how far this node's copies on other nodes are (NaN: it makes none, or none
    is known yet)."""
    noted = metrics.copies
    copied = noted.copied if noted is not None and noted.copied >= 0 else None
    lag = noted.newest - noted.copied if noted is not None and noted.copied >= 0 else None
    return (
        Family.one(
            "ftlaunch_memory_copy_step",
            "gauge",
            "The newest memory snapshot step of this node's ranks that every one of its peers holds "
            "(--memory-peers; NaN: none yet, or no copies).",
            _or(copied),
        ),
        Family.one(
            "ftlaunch_memory_copy_lag_steps",
            "gauge",
            "Steps this node's copies trail its newest snapshot (NaN: unknown).",
            _or(lag),
        ),
        Family.one(
            "ftlaunch_memory_copy_sent_bytes",
            "counter",
            "Bytes of whole copies this node sent to its peers.",
            float(noted.sent) if noted is not None else 0.0,
        ),
        Family.one(
            "ftlaunch_memory_copy_restores",
            "counter",
            "Times this node's ranks got their snapshots from another node's copy.",
            metrics.copy_restores,
        ),
    )


def _or(value: Optional[float], default: float = _UNKNOWN) -> float:
    return float(value) if value is not None else default
