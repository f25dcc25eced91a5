"""The held run (the only node's, node 0's) from its first attempt to its record in run.json."""

import dataclasses
import time
from typing import Optional

from launcher.agent.loop import Attempts, Health, run_attempts
from launcher.core.events import EventLog, RunEnd, Say
from launcher.core.outcomes import RunStatus
from launcher.core.policy import RestartPolicy
from launcher.core.recovery import goodput, recoveries
from launcher.core.results import RunResult
from launcher.grammar.errors import ExitCode
from launcher.roles.holder import RunHolder
from launcher.runs.run import Run

__all__ = ["hold"]


def hold(
    role: RunHolder,
    runner: Attempts,
    health: Health,
    run: Run,
    events: EventLog,
    say: Say,
    policy: RestartPolicy,
) -> RunResult:
    """A launch that starts no attempt leaves the run as it was: its record, its events, so its
    picture and its goodput."""
    try:
        refused = _refused(run, policy)
        if refused is not None:
            events.emit(RunEnd(exit_code=int(refused.exit_code), reason=refused.reason))  # this node's log
            return refused
        result = run_attempts(role, runner, health)
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


def _refused(run: Run, policy: RestartPolicy) -> Optional[RunResult]:
    """Why this launch starts no attempt, if it starts none. The run is named where it is now
    (run.json keeps where it was made, and a run dir can be copied elsewhere)."""
    if run.already_succeeded:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.state.updated_at))
        reason = f"run {run.terms.section.url} had already succeeded ({ended}); --fresh starts it again"
        return RunResult(ExitCode.SUCCESS, RunStatus.SUCCEEDED, [], reason)
    limit = policy.max_preemptions
    if 0 <= limit < run.preemptions:
        reason = f"preempted {run.preemptions} time(s), --max-preemptions {limit}"
        return RunResult(ExitCode.FAILED, RunStatus.FAILED, [], reason)
    return None


def _remove_uncommitted_parts(run: Run, say: Say) -> str:
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
