"""The supervisor: it picks this node's role once (the only node, node 0 of many, or a follower),
sets up what a run needs, and runs attempts in one loop: meet → start → monitor → stop →
conclude → decide → announce → (restart | end)."""

import contextlib
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, List, Optional

from launcher.attempt import AttemptRunner
from launcher.cluster.rendezvous import Rendezvous, host_job_store
from launcher.console import say as say_on_stderr
from launcher.core.config import LaunchConfig
from launcher.core.events import EventLog, RunEnd, RunStart
from launcher.core.outcomes import RunStatus
from launcher.core.recovery import goodput, recoveries
from launcher.core.results import AttemptResult, RunResult
from launcher.forked.linux import become_subreaper
from launcher.grammar.errors import ExitCode, JoinTimeout, SignalReceived, StartFailed, UsageError
from launcher.hangs.monitor import HangMonitor
from launcher.process.attempt_store import unless_stopping
from launcher.process.forkserver import ForkServer, ForkServerSpawner
from launcher.process.memory_tier import MemoryTier
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.signals import SignalInbox
from launcher.process.warm_spares import WarmSpares
from launcher.process.workers import PopenSpawner, Spawner
from launcher.roles.base import Role
from launcher.roles.follower import Follower
from launcher.roles.holder import RunHolder
from launcher.roles.leader import Leader
from launcher.roles.single import SingleNode
from launcher.runs.directory import LockRecord, RunDir
from launcher.runs.run import Run
from launcher.runs.taking import take
from worker_lib.core.storage import StorageError

__all__ = ["RunResult", "run_attempts", "supervise"]


def run_attempts(role: Role, runner: AttemptRunner) -> RunResult:
    """The loop: one attempt after another until the role decides the run is over."""
    attempts: List[AttemptResult] = []
    runner.warm_up()
    while True:
        try:
            plan = role.meet()
        except (SignalReceived, JoinTimeout) as err:
            return role.ended_waiting(err, attempts)
        try:
            local = runner.run(plan, role)
        except StartFailed as err:
            role.not_started(err)
            if not attempts:  # nothing of this launch ran, nothing was written: bad input
                raise UsageError(str(err)) from None
            raise
        concluded = role.conclude(local)
        attempts.append(concluded.result)
        ended, delay = role.decide(concluded, attempts)
        role.announce(concluded, ended, delay)
        runner.concluded(concluded.result, restarting=ended is None)
        if ended is not None:
            return ended
        role.pause(delay)


def supervise(
    config: LaunchConfig,
    signals: SignalInbox,
    say: Callable[[str], None] = say_on_stderr,
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
    plain = PopenSpawner(ignored=(config.group.preempt_signal,))
    if not config.group.fork_server:
        return plain
    log_file = config.group.log_dir / "forkserver.log"
    server = ForkServer(config.entry, log_file, (config.group.preempt_signal,), config.group.preload)
    cuda = config.group.backend == "nccl"  # each local rank's GPU is cuda:<local rank>
    spares = WarmSpares(config.group.nproc, cuda, say, on=config.group.warm_spare)
    return ForkServerSpawner(server, plain, say, spares)


def _follow(
    config: LaunchConfig, signals: SignalInbox, say, spawner: Spawner, console, on_events
) -> RunResult:
    """A node other than node 0: it holds nothing of the run."""
    become_subreaper()
    with EventLog(config.group.log_dir / "events.jsonl") as events:
        on_events(events)
        events.emit(RunStart(run_id=config.run.run_id, config=config.to_json(), pid=os.getpid()))
        with OrphanGuard() as guard, _memory_tier(guard) as memory:
            # Whether the script beats is node 0's knowledge (run.json); here it is learned afresh.
            hangs = HangMonitor(config.hangs, events, say, lambda: None, False)
            runner = AttemptRunner(config, events, signals, guard, say, spawner, console, hangs, memory)
            role = Follower(config, events, signals, say)
            try:
                result = run_attempts(role, runner)
            finally:
                role.close()
            events.emit(RunEnd(exit_code=int(result.exit_code), reason=result.reason))
            return result


def _lead(config: LaunchConfig, signals: SignalInbox, say, spawner: Spawner, console, on_events) -> RunResult:
    """Node 0, or the only node: hold the run and supervise it."""
    job_store = (
        host_job_store(config.cluster) if config.cluster.many_nodes else None
    )  # the others may already wait
    directory = RunDir(config.run.url, retries=False)
    taken_from = _acquire(directory, config, signals, say)  # before anything is written, logs included
    run: Optional[Run] = None
    try:
        become_subreaper()
        with EventLog(config.group.log_dir / "events.jsonl") as events:
            on_events(events)
            events.emit(RunStart(run_id=config.run.run_id, config=config.to_json(), pid=os.getpid()))
            with OrphanGuard() as guard, _memory_tier(guard) as memory:
                run = _open(config, directory, events, say, signals, taken_from)
                if job_store is None:
                    # The workers' store in a process forked from the fork server, when it serves;
                    # none once a signal came (the attempt will not start).
                    def stopping() -> bool:
                        return signals.first is not None

                    host = unless_stopping(
                        functools.partial(spawner.host_store, go_on=lambda: not stopping()), stopping
                    )
                    role: RunHolder = SingleNode(config, run, events, signals, say, config.restart, host)
                else:
                    rendezvous = Rendezvous(config.cluster, config.run.run_id, job_store)
                    role = Leader(config, run, events, signals, say, config.restart, rendezvous)
                beat_before = any(a.beat for a in run.state.attempts)  # e.g. before a kill -9 of ftlaunch
                hangs = HangMonitor(config.hangs, events, say, run.mark_first_step, beat_before)
                runner = AttemptRunner(config, events, signals, guard, say, spawner, console, hangs, memory)
                return _hold(role, runner, run, events, say)
    finally:
        if run is not None:
            run.close()
        else:
            directory.release()


def _acquire(directory: RunDir, config: LaunchConfig, signals: SignalInbox, say) -> Optional[LockRecord]:
    """Hold the run; storage that fails here (a full disk, no answer) is one line, and nothing
    has started."""
    try:
        return take(directory, config.run.lease, signals, say)
    except StorageError as err:
        raise UsageError(f"run dir {config.run.url} is not usable: {err}") from None


def _open(
    config: LaunchConfig, directory: RunDir, events: EventLog, say, signals: SignalInbox, taken_from
) -> Run:
    try:
        return Run(config, directory, events, say, signals, taken_from)
    except StorageError as err:
        raise UsageError(f"run dir {config.run.url} is not usable: {err}") from None


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


def _hold(role: RunHolder, runner: AttemptRunner, run: Run, events: EventLog, say) -> RunResult:
    """The held run from its first attempt to its record in run.json. A launch that starts no
    attempt leaves the run as it was: its record, its events, so its picture and its goodput."""
    try:
        refused = _refused(run, role.config)
        if refused is not None:
            events.emit(RunEnd(exit_code=int(refused.exit_code), reason=refused.reason))  # this node's log
            return refused
        result = run_attempts(role, runner)
    finally:
        role.close()  # many nodes: a node that comes late learns at once that the job is over
    lost = _remove_uncommitted_parts(run, say)
    if lost and result.status is RunStatus.SUCCEEDED:  # every rank exited 0, and yet
        result = dataclasses.replace(result, reason=f"{result.reason}; but {lost}")
    result = dataclasses.replace(
        result, recoveries=recoveries(events.logged), goodput=goodput(run.state.attempts, time.time())
    )
    run.finish(result.status, result.reason, int(result.exit_code))
    events.emit(RunEnd(exit_code=int(result.exit_code), reason=result.reason))
    return result


def _refused(run: Run, config: LaunchConfig) -> Optional[RunResult]:
    """Why this launch starts no attempt, if it starts none. The run is named where it is now
    (run.json keeps where it was made, and a run dir can be copied elsewhere)."""
    if run.already_succeeded:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.state.updated_at))
        reason = f"run {config.run.url} had already succeeded ({ended}); --fresh starts it again"
        return RunResult(ExitCode.SUCCESS, RunStatus.SUCCEEDED, [], reason)
    limit = config.restart.max_preemptions
    if 0 <= limit < run.preemptions:
        reason = f"preempted {run.preemptions} time(s), --max-preemptions {limit}"
        return RunResult(ExitCode.FAILED, RunStatus.FAILED, [], reason)
    return None


def _remove_uncommitted_parts(run: Run, say) -> str:
    """The run is over and no worker runs: parts that never got their commit marker go. Returns
    what the run's record must add when the newest of them is newer than every committed step
    (a final save that failed: the run's last work has no checkpoint), else ''."""
    removed = run.remove_uncommitted()
    if not removed.steps:
        return ""
    say(f"removed the parts of step(s) {', '.join(map(str, removed.steps))}, which were never committed")
    if not removed.newest_lost:
        return ""
    newest = removed.newest_committed
    return (
        f"the save of step {max(removed.steps)} was never committed; the newest checkpoint is "
        f"{'none' if newest is None else f'step {newest}'}"
    )
