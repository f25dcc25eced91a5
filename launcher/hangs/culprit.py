"""A hang's culprit across nodes: the rank that never entered the collective the others wait in,
from the last collective each rank entered (worker_lib reads it from torch's flight recorder into
the rank's slot; every node reports its ranks' to node 0). Pure."""

import collections
from typing import Iterable, Mapping

from launcher.core.beats import Entered

__all__ = ["hang_culprit"]


def hang_culprit(entered: Mapping[int, Entered]) -> str:
    """ "rank 2 (node 1) never entered all_reduce #57 (its last: #56), which ranks 0, 1 and 3 entered
    and wait in: they wait, they are not hung of their own"; '' when the evidence names no one
    (every rank in the same collective, or fewer than two ranks known)."""
    if len(entered) < 2:
        return ""
    top = max(e.seq for e in entered.values())
    at_top = [r for r, e in entered.items() if e.seq == top]
    kind = collections.Counter(entered[r].kind for r in at_top).most_common(1)[0][0]
    behind = sorted(r for r, e in entered.items() if e.seq < top)
    astray = sorted(r for r in at_top if entered[r].kind != kind)
    if top == 0 or not (behind or astray):
        return ""
    waiting = sorted(r for r in at_top if entered[r].kind == kind)
    parts = []
    for rank in behind:
        last = entered[rank]
        theirs = f"its last: {last.kind} #{last.seq}" if last.seq else "it entered none"
        parts.append(f"{_who([rank], entered)} never entered {kind} #{top} ({theirs})")
    for rank in astray:
        parts.append(f"{_who([rank], entered)} entered {entered[rank].kind} as #{top}, not {kind}")
    return (
        "; ".join(parts)
        + f", which {_who(waiting, entered)} entered and wait in: they wait, they are not hung of their own"
    )


def _who(ranks: Iterable[int], entered: Mapping[int, Entered]) -> str:
    named = [str(r) if entered[r].node is None else f"{r} (node {entered[r].node})" for r in ranks]
    return f"rank {named[0]}" if len(named) == 1 else f"ranks {', '.join(named[:-1])} and {named[-1]}"
