"""How long each recovery took, phase by phase, and how much of the wall time went into steps
that were kept. Pure: computed from the event log (monotonic times) and the run's attempts."""

import dataclasses
from typing import List, Optional, Sequence

from launcher.core.events import CheckpointLoaded, Event, FirstStep, Logged, Transition, first_of, of_kind
from launcher.core.group_state import GroupState
from launcher.core.records import AttemptEntry, kept_seconds

__all__ = ["Recovery", "goodput", "recoveries"]

_FAILED = (GroupState.FAILED, GroupState.HUNG)


@dataclasses.dataclass(frozen=True)
class Recovery:
    """From attempt ``failed`` to the next one; seconds per phase (None: not observed)."""

    failed: int
    detect: Optional[float]  # failure → the supervisor's verdict
    stop: float  # verdict → the old group gone
    restart: float  # → the new group running (backoff and spawn)
    load: Optional[float]  # → every rank has loaded its checkpoint: interpreter start, imports,
    # joining the group and the load itself (worker_lib reports when the load returned)
    first_step: Optional[float]  # → every rank of the new group has beaten (needs heartbeats)
    loaded: str = ""  # what the new group loaded: "step 120 from memory"; "": nothing, or unknown

    @property
    def downtime(self) -> float:
        return sum(
            p for p in (self.detect, self.stop, self.restart, self.load, self.first_step) if p is not None
        )


def recoveries(log: Sequence[Logged[Event]]) -> List[Recovery]:
    found = []
    failed_attempts = {e.attempt for e in _entered(log, *_FAILED) if e.attempt is not None}
    for attempt in sorted(failed_attempts):
        verdict = next(iter(_entered(log, *_FAILED, attempt=attempt)), None)
        stopped = next(iter(_entered(log, GroupState.STOPPED, attempt=attempt)), None)
        running = next(iter(_entered(log, GroupState.RUNNING, attempt=attempt + 1)), None)
        if verdict is None or stopped is None or running is None:
            continue  # the run ended there
        failed_at = verdict.event.failed_at
        loaded = first_of(log, CheckpointLoaded, attempt + 1)
        loaded_at = loaded.event.t_done if loaded else None  # the workers' own clock reading
        stepped = first_of(log, FirstStep, attempt + 1)
        found.append(
            Recovery(
                failed=attempt,
                detect=verdict.t_mono - failed_at if failed_at is not None else None,
                stop=stopped.t_mono - verdict.t_mono,
                restart=running.t_mono - stopped.t_mono,
                load=loaded_at - running.t_mono if loaded_at is not None else None,
                first_step=stepped.t_mono - (loaded_at or running.t_mono) if stepped else None,
                loaded=f"step {loaded.event.step} from {loaded.event.tier}"
                if loaded and loaded.event.tier
                else "",
            )
        )
    return found


def goodput(attempts: Sequence[AttemptEntry], now: float) -> Optional[float]:
    """Share of the run's wall time (first start → ``now``) spent stepping towards what was kept
    (``runs.records.kept_seconds``): start-up and the work lost after the last commit count
    against it. None without attempts, or when what was kept is unknown."""
    if not attempts:
        return None
    kept = kept_seconds(attempts, now)
    total = now - attempts[0].started_at
    return max(0.0, min(1.0, kept / total)) if kept is not None and total > 0 else None


def _entered(
    log: Sequence[Logged[Event]], *states: GroupState, attempt: Optional[int] = None
) -> List[Logged[Transition]]:
    """The transitions into one of ``states`` (of ``attempt``, when given), in order."""
    return [
        t
        for t in of_kind(log, Transition)
        if t.event.new in states and (attempt is None or t.attempt == attempt)
    ]
