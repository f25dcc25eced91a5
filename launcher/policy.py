"""Restart policy: pure decisions from the failure history, no processes, no clocks read."""

import dataclasses

__all__ = ["FailurePolicy", "RestartDecision"]


@dataclasses.dataclass(frozen=True)
class RestartDecision:
    restart: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """``max_failures`` failed groups are restarted; the next one ends the run (-1: never)."""

    max_failures: int

    def after_failure(self, failures_so_far: int) -> RestartDecision:
        """``failures_so_far`` counts failed groups, the one that just failed included."""
        if self.max_failures < 0:
            return RestartDecision(True, f"failure {failures_so_far} (no limit)")
        if failures_so_far <= self.max_failures:
            return RestartDecision(True, f"failure {failures_so_far} of {self.max_failures} allowed")
        if self.max_failures == 0:
            return RestartDecision(False, "no failures allowed (--max-failures 0)")
        return RestartDecision(False, f"failure budget spent ({self.max_failures} allowed)")
