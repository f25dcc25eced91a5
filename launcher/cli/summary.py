"""The lines ftlaunch prints when a run ends: outcome, every failure, the root cause."""

from typing import List

from launcher.core.failures import Failure, HangFailure, NodeLostFailure
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.recovery import Recovery
from launcher.core.results import RunResult
from launcher.grammar.errors import ExitCode

__all__ = ["summary_lines"]


_UNHEALTHY = (
    "  exit 8: this node is unhealthy or excluded: drain or replace it; the same command on a healthy "
    "node resumes the run, or joins it"
)


def summary_lines(result: RunResult) -> List[str]:
    unhealthy = [_UNHEALTHY] if result.exit_code == ExitCode.UNHEALTHY else []
    if not result.attempts:  # nothing ran: the run had already succeeded, or may not go on
        return [result.reason] + unhealthy
    failed = [a for a in result.attempts if a.outcome is AttemptOutcome.FAILED]
    lines = [
        f"{result.status.value} after {len(result.attempts)} attempt(s), "
        f"{len(failed)} failed group(s): {result.reason} (exit {int(result.exit_code)})"
    ]
    for attempt in result.attempts:
        if attempt.resize:  # an elastic job ran this attempt on another number of nodes: why
            lines.append(f"  attempt {attempt.attempt}: resized, {attempt.resize}")
        if attempt.replaced:  # --standby-nodes: which standby took which lost node's place
            lines.append(f"  attempt {attempt.attempt}: {attempt.replaced}")
        if attempt.restored:  # --memory-peers: whose snapshots came from another node's copy
            lines.append(f"  attempt {attempt.attempt}: {attempt.restored}")
        if attempt.outcome is AttemptOutcome.RESIZED:  # an elastic job's nodes changed: why
            lines.append(f"  attempt {attempt.attempt}: the job's nodes changed ({attempt.cause})")
        elif attempt.outcome is AttemptOutcome.NODE_LOST:
            lines.append(f"  attempt {attempt.attempt}: {attempt.cause} (not a worker failure: not counted)")
        elif attempt.outcome is AttemptOutcome.FAILED:
            extra = len(attempt.failures) - 1
            more = f" (+{extra} more rank(s) failed)" if extra else ""
            lines.append(f"  attempt {attempt.attempt}: {attempt.describe_cause()}{more}")
            if attempt.culprit:  # a hang: who never entered the collective the others wait in
                lines.append(f"  attempt {attempt.attempt}: {attempt.culprit}")
    for r in result.recoveries:
        lines.append(f"  recovery after attempt {r.failed}: {_phases(r)}")
    if result.recoveries:
        down = sum(r.downtime for r in result.recoveries)
        lines.append(f"  downtime {down:.2f} s in {len(result.recoveries)} recovery(ies)")
    if not result.holds_run:
        lines.append("  recoveries and goodput: in node 0's summary (node 0 holds the run)")
    elif result.goodput is not None:
        lines.append(f"  goodput {100 * result.goodput:.0f}% (wall time spent on steps that were kept)")
    else:
        lines.append(
            "  goodput unknown: ftlaunch sees steps through ft.heartbeat, and what a failed attempt kept "
            "through worker_lib's checkpoints"
        )
    if failed and result.status is RunStatus.FAILED and failed[-1].root_cause is not None:
        lines += _root_cause_detail(failed[-1].root_cause)
    return lines + unhealthy


def _phases(r: Recovery) -> str:
    parts = [
        ("detect", r.detect),
        ("stop", r.stop),
        ("restart", r.restart),
        ("start and load", r.load),
        ("first step", r.first_step),
    ]
    shown = ", ".join(f"{name} {value:.2f} s" for name, value in parts if value is not None)
    loaded = f"; loaded {r.loaded}" if r.loaded else ""
    return f"{shown} (down {r.downtime:.2f} s{loaded})"


def _root_cause_detail(failure: Failure) -> List[str]:
    lines = [f"root cause: {failure.describe()}"]
    if isinstance(failure, HangFailure) and failure.stack:
        lines.append(f"  where its main thread was (every thread's stack is in {failure.log_file}):")
        lines += [f"  | {frame}" for frame in failure.stack]
    elif isinstance(failure, HangFailure):
        lines.append(
            f"  no stack: the rank did not answer the dump signal (stopped?); see {failure.log_file}"
        )
    elif isinstance(failure, NodeLostFailure):
        lines.append(
            f"  its workers died with it; relaunch ftlaunch on node {failure.node} to resume the job"
        )
    elif failure.error and failure.error.traceback:
        lines.append("  traceback (from TORCHELASTIC_ERROR_FILE):")
        lines += [f"  | {line}" for line in failure.error.traceback.rstrip().splitlines()]
    elif failure.log_tail:
        lines.append(f"  last lines of {failure.log_file}:")
        lines += [f"  | {line}" for line in failure.log_tail]
    return lines
