"""One node's agent from its start to its end: it builds the node's parts from the launch's
sections, picks the node's role once (the only node, node 0 of many, or a follower), runs the
loop, and tears it all down."""

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator, Optional, Tuple

from launcher.agent import parts
from launcher.agent.attempt import AttemptRunner, Workers
from launcher.agent.copies import NO_COPIES, NoCopies, NodeCopies, copy_address
from launcher.agent.health import NodeHealth
from launcher.agent.held import hold
from launcher.agent.loop import run_attempts
from launcher.cluster.rendezvous import Rendezvous, host_job_store
from launcher.core.config import LaunchConfig, RunSection
from launcher.core.events import EventLog, RunEnd, RunStart, Say
from launcher.core.results import RunResult
from launcher.forked.linux import become_subreaper
from launcher.grammar.errors import UsageError
from launcher.hangs.monitor import HangMonitor
from launcher.process.attempt_store import unless_stopping
from launcher.process.forkserver import ForkServer, ForkServerSpawner
from launcher.process.kit import NodeKit
from launcher.process.memory_tier import MemoryTier
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.signals import SignalInbox
from launcher.process.warm_spares import WarmSpares
from launcher.process.workers import PopenSpawner, Spawner
from launcher.roles.follower import Follower
from launcher.roles.holder import RunHolder
from launcher.roles.leader import Leader
from launcher.roles.single import SingleNode
from launcher.runs.directory import LockRecord, RunDir
from launcher.runs.opening import RunTerms
from launcher.runs.run import Run
from launcher.runs.taking import take
from worker_lib.core.storage import StorageError

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["RunResult", "supervise"]

Console = Tuple[BinaryIO, BinaryIO]
OnEvents = Callable[[EventLog], None]


def supervise(
    config: LaunchConfig,
    signals: SignalInbox,
    say: Callable[[str], None],
    spawner: Optional[Spawner] = None,
    console_out: Optional[BinaryIO] = None,
    console_err: Optional[BinaryIO] = None,
    on_events: Callable[[EventLog], None] = lambda _events: None,
) -> RunResult:
    """Hold the run (unless a follower), set up what a run needs, run it to its end, and tear it
    all down. The caller owns this process (the supervisor reaps its children) and has opened
    ``signals``; ``on_events`` is handed the event log once it is open (the metrics read it)."""
    console = (console_out or sys.stdout.buffer, console_err or sys.stderr.buffer)
    own_spawner = spawner is None
    spawner = spawner or _spawner_for(config, say)
    try:
        if config.cluster.many_nodes and not config.cluster.leads:
            return _follow(config, signals, say, spawner, console, on_events)
        return _lead(config, signals, say, spawner, console, on_events)
    finally:
        if own_spawner and isinstance(spawner, ForkServerSpawner):
            spawner.close()


def _spawner_for(config: LaunchConfig, say: Callable[[str], None]) -> Spawner:
    """Plain spawning, or forks of a warm fork server that falls back to it."""
    group = config.group
    plain = PopenSpawner(ignored=(group.preempt_signal,))
    if not group.fork_server:
        return plain
    server = ForkServer(
        config.entry, group.log_dir / "forkserver.log", (group.preempt_signal,), group.preload
    )
    cuda = group.backend == "nccl"  # each local rank's GPU is cuda:<local rank>
    spares = WarmSpares(group.nproc, cuda, say, on=group.warm_spare)
    return ForkServerSpawner(server, plain, say, spares)


def _follow(
    config: LaunchConfig,
    signals: SignalInbox,
    say: Say,
    spawner: Spawner,
    console: Console,
    on_events: OnEvents,
) -> RunResult:
    """A node other than node 0: it holds nothing of the run."""
    with _node(config, signals, say, on_events) as (kit, guard, memory, copies):
        # Whether the script beats is node 0's knowledge (run.json); here it is learned afresh.
        hangs = HangMonitor(config.hangs, kit.events, say, lambda: None, False)
        workers = Workers(parts.worker_plan(config), spawner, guard, console, memory, copies)
        role = Follower(parts.membership(config, copies.address), config.run, kit)
        health = NodeHealth(parts.health_terms(config), kit, guard, memory)
        try:
            result = run_attempts(role, _runner(config, kit, workers, hangs), health)
        finally:
            role.close()
        kit.events.emit(RunEnd(exit_code=int(result.exit_code), reason=result.reason))
        return result


def _lead(
    config: LaunchConfig,
    signals: SignalInbox,
    say: Say,
    spawner: Spawner,
    console: Console,
    on_events: OnEvents,
) -> RunResult:
    """Node 0, or the only node: hold the run and supervise it."""
    # The job's store first: the other nodes may already wait for it.
    job_store = host_job_store(config.cluster) if config.cluster.many_nodes else None
    directory = RunDir(config.run.url, retries=False)
    taken_from = _acquire(directory, config.run, signals, say)  # before anything is written, logs included
    run: Optional[Run] = None
    try:
        with _node(config, signals, say, on_events) as (kit, guard, memory, copies):
            run = _open(parts.run_terms(config), directory, kit, taken_from)
            role = _holder_role(config, run, kit, spawner, job_store, copies.address)
            beat_before = any(a.beat for a in run.state.attempts)  # e.g. before a kill -9 of ftlaunch
            hangs = HangMonitor(config.hangs, kit.events, say, run.mark_first_step, beat_before)
            workers = Workers(parts.worker_plan(config), spawner, guard, console, memory, copies)
            health = NodeHealth(parts.health_terms(config), kit, guard, memory)
            runner = _runner(config, kit, workers, hangs)
            return hold(role, runner, health, run, kit.events, say, config.restart)
    finally:
        if run is not None:
            run.close()
        else:
            directory.release()


def _holder_role(
    config: LaunchConfig, run: Run, kit: NodeKit, spawner: Spawner, job_store: Optional["Store"], copies: str
) -> RunHolder:
    """The only node's role, or node 0's of many (``job_store``: the job's store it hosts;
    ``copies``: its copy server)."""
    store_at = (config.group.master_addr, config.group.master_port)
    injectable = config.chaos.plan is not None
    if job_store is not None:
        rendezvous = Rendezvous(config.cluster, config.run.run_id, job_store)
        membership = parts.membership(config, copies)
        return Leader(membership, run, kit, config.restart, store_at, injectable, rendezvous)

    # The workers' store in a process forked from the fork server, when it serves; none once a
    # signal came (the attempt will not start).
    def stopping() -> bool:
        return kit.signals.first is not None

    host = unless_stopping(functools.partial(spawner.host_store, go_on=lambda: not stopping()), stopping)
    return SingleNode(config.group.nproc, run, kit, config.restart, store_at, injectable, host)


def _runner(config: LaunchConfig, kit: NodeKit, workers: Workers, hangs: HangMonitor) -> AttemptRunner:
    node = config.cluster.node_rank if config.cluster.many_nodes else None
    return AttemptRunner(kit, workers, hangs, parts.chaos(config, kit.events, kit.say), node)


def _acquire(directory: RunDir, run: RunSection, signals: SignalInbox, say: Say) -> Optional[LockRecord]:
    """Hold the run; storage that fails here (a full disk, no answer) is one line, and nothing
    has started."""
    try:
        return take(directory, run.lease, signals, say)
    except StorageError as err:
        raise UsageError(f"run dir {run.url} is not usable: {err}") from None


def _open(terms: RunTerms, directory: RunDir, kit: NodeKit, taken_from: Optional[LockRecord]) -> Run:
    try:
        return Run(terms, directory, kit, taken_from)
    except StorageError as err:
        raise UsageError(f"run dir {terms.section.url} is not usable: {err}") from None


@contextlib.contextmanager
def _node(
    config: LaunchConfig, signals: SignalInbox, say: Say, on_events: OnEvents
) -> Iterator[Tuple[NodeKit, OrphanGuard, Optional[Path], NoCopies]]:
    """What every node's supervisor holds for its life, whatever its role: its descendants
    (a subreaper), its event log (handed to ``on_events``, opened by RunStart), the orphan guard,
    the memory tier and its copies to other nodes."""
    become_subreaper()
    with EventLog(config.group.log_dir / "events.jsonl") as events:
        on_events(events)
        events.emit(RunStart(run_id=config.run.run_id, config=config.to_json(), pid=os.getpid()))
        with (
            OrphanGuard() as guard,
            _memory_tier(guard) as memory,
            _copies(config, memory, events, say) as copies,
        ):
            yield NodeKit(events, signals, say), guard, memory, copies


@contextlib.contextmanager
def _copies(config: LaunchConfig, memory: Optional[Path], events: EventLog, say: Say) -> Iterator[NoCopies]:
    """--memory-peers: the tier's copies to and from the other nodes, for the supervisor's life."""
    if memory is None or not config.cluster.many_nodes or not config.copies.peers:
        yield NO_COPIES
        return
    address = copy_address(config.cluster.rdzv_endpoint, config.cluster.leads)
    copies = NodeCopies(memory, config.cluster.node_rank, config.copies, address, events, say)
    try:
        yield copies
    finally:
        copies.close()


@contextlib.contextmanager
def _memory_tier(guard: OrphanGuard) -> Iterator[Optional[Path]]:
    """The node's memory tier for this supervisor's life: its folder, removed at the end, and by
    the orphan guard if this process is killed."""
    tier = MemoryTier()
    if tier.folder is not None:
        guard.remove_at_end(str(tier.folder))
    try:
        yield tier.folder
    finally:
        tier.close()
