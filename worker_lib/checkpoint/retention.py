"""Which committed steps to delete: pure logic, as Ray's CheckpointConfig keeps them."""

import dataclasses
from typing import Dict, List, Optional, Sequence

__all__ = ["RetentionPolicy", "CommittedStep"]


@dataclasses.dataclass(frozen=True)
class CommittedStep:
    step: int
    metrics: Dict[str, float]


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` steps, and the best ``keep_best`` by ``metric``."""

    keep_last: int = 2
    keep_best: int = 0
    metric: Optional[str] = None
    mode: str = "min"  # "min": lower is better (a loss); "max": higher is better (accuracy)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError("keep_last must be at least 1: the newest committed step is always kept")
        if self.keep_best < 0 or (self.keep_best and not self.metric):
            raise ValueError("keep_best needs a metric name, and cannot be negative")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")

    def to_delete(self, committed: Sequence[CommittedStep]) -> List[int]:
        """Steps to delete, oldest first. The newest step is never among them."""
        by_step = sorted(committed, key=lambda c: c.step, reverse=True)
        keep = {c.step for c in by_step[: self.keep_last]}
        keep |= {c.step for c in self._best(by_step)}
        return sorted(c.step for c in by_step if c.step not in keep)

    def _best(self, steps: Sequence[CommittedStep]) -> List[CommittedStep]:
        metric = self.metric
        if not self.keep_best or metric is None:  # __post_init__ allows no keep_best without a metric
            return []
        scored = [c for c in steps if metric in c.metrics]
        # Ties go to the newer step (steps are newest first and sorted() is stable).
        ranked = sorted(scored, key=lambda c: c.metrics[metric], reverse=self.mode == "max")
        return ranked[: self.keep_best]
