"""Restart policy: pure decisions from the attempt history and a clock reading passed in.

- budget: at most ``max_failures`` failed attempts (-1: no limit) are restarted, counting only
  failures inside ``failure_window`` seconds when one is set (systemd's StartLimitIntervalSec);
- crash loop: ``crash_loop`` failed attempts in a row known to have made no progress stop the run
  early (0: off); progress is judged from evidence (``launcher.core.evidence``), and an attempt whose
  progress is unknown ends the row, as one that progressed does;
- backoff: the first failure after progress restarts at once; each further one in a row known to
  have made no progress waits twice as long, from ``backoff`` seconds up to ``backoff_cap``.
  Unknown progress gets no backoff, as under torchrun.
- injected: a failure that --chaos caused is restarted like any other, but counts against the
  budget only with ``count_injected`` (--chaos-counts), and neither ends nor extends a crash loop.
"""

import dataclasses
import enum
import math
from typing import Optional, Sequence, Tuple

from launcher.core.outcomes import AttemptOutcome
from launcher.grammar.errors import UsageError

__all__ = ["AttemptRecord", "RestartPolicy", "RestartDecision", "Verdict"]


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    """What the policy needs to know of one finished attempt."""

    attempt: int
    outcome: Optional[AttemptOutcome]  # None: running, or its supervisor never came back
    ended_at: float  # seconds, on the clock ``now`` is read from
    progressed: Optional[bool] = None  # None: unknown (no evidence either way)
    injected: bool = False  # its root cause was a fault --chaos injected
    blamed_node: Optional[int] = None  # many nodes: its root cause's node, where the blame is sure


class Verdict(str, enum.Enum):
    RESTART = "RESTART"
    BUDGET_SPENT = "BUDGET_SPENT"
    CRASH_LOOP = "CRASH_LOOP"


@dataclasses.dataclass(frozen=True)
class RestartDecision:
    verdict: Verdict
    reason: str
    delay: float = 0.0  # seconds to wait before the restart

    @property
    def restart(self) -> bool:
        return self.verdict is Verdict.RESTART


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """The failure budget and the pauses between restarts: the config's restart section, built
    from the option values, and the decisions made from it."""

    max_failures: int = 3  # failed groups tolerated; -1: unlimited, 0: none
    failure_window: Optional[float] = None  # seconds; None: every failure counts
    crash_loop: int = 3  # failed attempts in a row known to have made no progress; 0: off
    backoff: float = 1.0  # seconds before the second restart in a row; doubles after
    backoff_cap: float = 60.0
    count_injected: bool = False  # --chaos-counts: injected failures spend the budget
    max_preemptions: int = -1  # preempted attempts a run may resume from; -1: unlimited
    exclude_after: int = 0  # --exclude-after: a node blamed for this many failures goes; 0: never

    def __post_init__(self) -> None:
        for value, option in (
            (self.failure_window, "--failure-window"),
            (self.backoff, "--backoff"),
            (self.backoff_cap, "--max-backoff"),
        ):
            if value is not None and not math.isfinite(value):  # nan compares false with everything
                raise UsageError(f"{option} must be a finite number of seconds, got {value}")
        if self.max_failures < -1:
            raise UsageError(f"--max-failures must be -1 (unlimited) or more, got {self.max_failures}")
        if self.max_preemptions < -1:
            raise UsageError(f"--max-preemptions must be -1 (unlimited) or more, got {self.max_preemptions}")
        if self.exclude_after < 0:
            raise UsageError(f"--exclude-after must be 0 (never) or more, got {self.exclude_after}")
        if self.crash_loop < 0:
            raise UsageError(f"--crash-loop must be 0 (off) or more, got {self.crash_loop}")
        if self.failure_window is not None and self.failure_window <= 0:
            raise UsageError("--failure-window must be more than 0 seconds")

    def after_failure(self, history: Sequence[AttemptRecord], now: float) -> RestartDecision:
        """``history``: the attempts that count, oldest first, the one that just failed last."""
        stuck = _stalled_in_a_row(history)
        if self.crash_loop > 0 and stuck >= self.crash_loop:
            return RestartDecision(
                Verdict.CRASH_LOOP, f"crash loop: {stuck} attempts in a row failed without progress"
            )
        counted = self.counted_failures(history, now)
        window = f" in the last {self.failure_window:g} s" if self.failure_window is not None else ""
        if self.max_failures >= 0 and counted > self.max_failures:
            if self.max_failures == 0:
                return RestartDecision(Verdict.BUDGET_SPENT, "no failures allowed (--max-failures 0)")
            return RestartDecision(
                Verdict.BUDGET_SPENT,
                f"failure budget spent ({counted} failures{window}, {self.max_failures} allowed)",
            )
        limit = " (no limit)" if self.max_failures < 0 else f" of {self.max_failures} allowed"
        reason = f"failure {counted}{window}{limit}"
        if history and history[-1].injected and not self.count_injected:
            reason = f"an injected failure, not counted ({counted}{window}{limit}; --chaos-counts counts it)"
        return RestartDecision(Verdict.RESTART, reason, self.delay(stuck))

    def may_restart_a_failure(self, history: Sequence[AttemptRecord], now: float, injectable: bool) -> bool:
        """Whether a failure now could be restarted: the budget has room for it (``history``: the
        finished attempts that count; ``injectable``: --chaos may have caused it, which counts only
        with ``count_injected``). The crash loop is not judged: its evidence comes after the stop."""
        if self.max_failures < 0:
            return True
        this = 0 if injectable and not self.count_injected else 1
        return self.counted_failures(history, now) + this <= self.max_failures

    def counted_failures(self, history: Sequence[AttemptRecord], now: float) -> int:
        return sum(
            1
            for a in history
            if a.outcome is AttemptOutcome.FAILED
            and (self.count_injected or not a.injected)
            and (self.failure_window is None or now - a.ended_at <= self.failure_window)
        )

    def node_to_exclude(self, history: Sequence[AttemptRecord], now: float) -> Optional[Tuple[int, int]]:
        """(node, failures): the node surely blamed for the failure that just ended ``history``,
        once it is the root cause of ``exclude_after`` failures within the window (injected ones
        too: --chaos rehearses exactly this); None: no node to exclude."""
        if self.exclude_after <= 0 or not history or history[-1].blamed_node is None:
            return None
        node = history[-1].blamed_node
        blamed = sum(
            1
            for a in history
            if a.outcome is AttemptOutcome.FAILED
            and a.blamed_node == node
            and (self.failure_window is None or now - a.ended_at <= self.failure_window)
        )
        return (node, blamed) if blamed >= self.exclude_after else None

    def delay(self, failures_in_a_row: int) -> float:
        if failures_in_a_row <= 1:
            return 0.0
        return float(min(self.backoff_cap, self.backoff * 2 ** (failures_in_a_row - 2)))


# Attempts that ended for something other than the workers: a supervisor died (this one, or a
# node's in a job of many), or an elastic job's nodes changed.
_NOT_THE_WORKERS = (AttemptOutcome.SUPERVISOR_LOST, AttemptOutcome.RESIZED, AttemptOutcome.NODE_LOST)


def _stalled_in_a_row(history: Sequence[AttemptRecord]) -> int:
    """Failed attempts known to have made no progress at the end of ``history``; any other attempt
    ends the row, except a lost supervisor, a change of an elastic job's nodes or an injected fault
    (not the workers' doing: they neither end nor extend it)."""
    count = 0
    for record in reversed(history):
        if record.outcome in _NOT_THE_WORKERS or record.injected:
            continue
        if record.outcome is not AttemptOutcome.FAILED or record.progressed is not False:
            break
        count += 1
    return count
