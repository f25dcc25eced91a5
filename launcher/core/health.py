"""A node's health before an attempt, as records: each check's result and the verdict over them
(pure). Unknown (a check that cannot run here: no GPU, no NVML) is never said as healthy, and
never fails the node."""

import dataclasses
import enum
from typing import Mapping, Optional, Sequence, Tuple

__all__ = ["CheckResult", "CheckStatus", "HealthReport", "tier_room_needed"]


class CheckStatus(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNKNOWN = "unknown"  # could not be checked here (said why): neither healthy nor not


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check: its name (``command``, ``run dir``, ``gpu 0``...), how it ended and why."""

    name: str
    status: CheckStatus
    detail: str = ""

    @classmethod
    def passed(cls, name: str, detail: str = "") -> "CheckResult":
        return cls(name, CheckStatus.PASSED, detail)

    @classmethod
    def failed(cls, name: str, detail: str) -> "CheckResult":
        return cls(name, CheckStatus.FAILED, detail)

    @classmethod
    def unknown(cls, name: str, detail: str) -> "CheckResult":
        return cls(name, CheckStatus.UNKNOWN, detail)


@dataclasses.dataclass(frozen=True)
class HealthReport:
    """Every check run before one attempt, in the order they ran (the first failure stops them)."""

    results: Tuple[CheckResult, ...]

    @property
    def failure(self) -> Optional[CheckResult]:
        return next((r for r in self.results if r.status is CheckStatus.FAILED), None)

    @property
    def healthy(self) -> bool:
        return self.failure is None

    def named(self, status: CheckStatus) -> Tuple[str, ...]:
        return tuple(r.name for r in self.results if r.status is status)

    def line(self, node: int) -> str:
        """One line: the failure and why, or what passed and what could not be checked."""
        failure = self.failure
        if failure is not None:
            return f"node {node} is unhealthy: {failure.name} failed: {failure.detail}"
        unknown = "; ".join(
            f"{r.name}: unknown ({r.detail})" for r in self.results if r.status is CheckStatus.UNKNOWN
        )
        passed = ", ".join(self.named(CheckStatus.PASSED)) or "nothing"
        return f"node {node} health: passed {passed}" + (f"; {unknown}" if unknown else "")


def tier_room_needed(slots: Mapping[int, Sequence[int]], per_rank: int = 2) -> Optional[int]:
    """Bytes /dev/shm must still have for the memory tier to hold ``per_rank`` snapshots of each
    rank at the sizes seen. ``slots``: each rank's slots already made (their sizes, reserved:
    they stay across a restart). None: no rank has made one (the tier is not used, or not yet)."""
    if not any(slots.values()):
        return None
    return sum(max(sizes) * max(0, per_rank - len(sizes)) for sizes in slots.values() if sizes)
