"""Did an attempt make progress? Judged from evidence only; pure.

ftlaunch sees two kinds of progress: checkpoints committed through worker_lib, and the steps ranks
report with ``ft.heartbeat(step)``. A script that uses neither (its own checkpoints, no beats) is
not "stuck" for that: its progress is UNKNOWN, and the policy then does what torchrun would
(restart within the budget, no crash-loop stop, no backoff). The one judgement made without either
kind is about attempts that fail within moments of their start: nothing can have been done.
"""

import dataclasses
import enum
from typing import Optional, Tuple

__all__ = ["FAST_FAILURE_S", "Progress", "ProgressEvidence", "judge_progress"]

# A group that fails this soon after it started has done no work: no Python interpreter that
# imports torch is even running its script by then.
FAST_FAILURE_S = 1.0


class Progress(str, enum.Enum):
    MADE = "made"
    NONE = "none"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class ProgressEvidence:
    """What the supervisor saw of one attempt, and of the run before it."""

    commits_seen: bool  # the checkpoint dir could be listed at the attempt's end
    committed_before: Optional[int]  # the newest committed step when the attempt started
    committed_after: Optional[int]  # ... when it ended
    beat: bool  # some rank of the attempt called ft.heartbeat()
    furthest_step: Optional[int]  # the highest step a rank beat with; None: no step given
    beat_before: bool  # an earlier attempt of the run beat: the script calls ft.heartbeat()
    furthest_before: Optional[int]  # the highest step any earlier attempt beat with
    lived: float  # seconds from the group's start to its end


def judge_progress(e: ProgressEvidence) -> Tuple[Progress, str]:
    """The verdict and the evidence for it, in words."""
    if e.commits_seen and e.committed_after is not None and e.committed_after != e.committed_before:
        return Progress.MADE, f"committed step {e.committed_after}"
    if e.furthest_step is not None:
        if e.furthest_before is None or e.furthest_step > e.furthest_before:
            return Progress.MADE, f"reached step {e.furthest_step}"
        return Progress.NONE, f"no step beyond {e.furthest_before}, no new commit"
    if e.beat_before and not e.beat:
        return Progress.NONE, "ended before its first heartbeat"
    if e.commits_seen and e.committed_before is not None:
        return Progress.NONE, f"no commit after step {e.committed_before}"
    if e.lived < FAST_FAILURE_S:
        return Progress.NONE, f"ended {e.lived:.1f} s after it started"
    return Progress.UNKNOWN, "no worker_lib commit, no heartbeat step to judge by"
