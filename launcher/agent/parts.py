"""The launch's configuration turned into the parts of one node's agent, each given only its own
sections: what the workers run, what the run records, what this node brings to a job of many,
its health check, and the faults --chaos injects."""

import os

from launcher.agent.health import HealthTerms, ranks_gpus
from launcher.chaos.driver import NoChaos, chaos_for
from launcher.core.config import LaunchConfig
from launcher.core.events import EventLog, Say
from launcher.core.layout import Layout
from launcher.process.plan import WorkerPlan
from launcher.roles.membership import Membership
from launcher.runs.opening import RunTerms

__all__ = ["chaos", "every_node", "health_terms", "membership", "run_terms", "worker_plan"]


def every_node(config: LaunchConfig) -> Layout:
    """This node's ranks when every node of the job is present."""
    return Layout.every_node(config.cluster.nnodes, config.cluster.node_rank, config.group.nproc)


def worker_plan(config: LaunchConfig) -> WorkerPlan:
    return WorkerPlan(
        entry=config.entry,
        group=config.group,
        run_id=config.run.run_id,
        max_restarts=config.restart.max_failures,
        every_node=every_node(config),
        chaos=config.chaos.plan is not None,
    )


def run_terms(config: LaunchConfig) -> RunTerms:
    return RunTerms(
        section=config.run,
        command=config.entry.command,
        nproc=config.group.nproc,
        nnodes=config.cluster.nnodes,
        checkpoint_url=config.group.checkpoint_url,
        named_by_default=config.has_default_name,
        recorded=config.to_json(),
    )


def membership(config: LaunchConfig, copies: str = "") -> Membership:
    """``copies``: this node's copy server, if it runs one."""
    return Membership(
        cluster=config.cluster,
        nproc=config.group.nproc,
        command=config.entry.command,
        run_id=config.run.run_id,
        grace_period=config.group.grace_period,
        copies=copies,
    )


def chaos(config: LaunchConfig, events: EventLog, say: Say) -> NoChaos:
    positions = config.cluster.standby > 0  # a rank's node changes when a standby takes its place
    return chaos_for(config.chaos.plan, every_node(config), events, say, positions)


def health_terms(config: LaunchConfig) -> HealthTerms:
    """The storage this node writes: the run dir where it holds the run, the checkpoints' always."""
    storage = {}
    if config.cluster.leads:
        storage["run dir (--run-dir)"] = config.run.url
    if config.group.checkpoint_url:
        storage["checkpoint storage (--checkpoint-dir)"] = config.group.checkpoint_url
    gpus = ranks_gpus(config.group.nproc, config.group.backend, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return HealthTerms(
        section=config.health,
        node=config.cluster.node_rank,
        log_dir=config.group.log_dir,
        storage=storage,
        storage_timeout=config.run.storage_timeout,
        gpus=gpus,
    )
