"""Before a node's workers start: where none of its ranks holds a snapshot of its own (a standby
that took a lost node's place, a node relaunched with an empty /dev/shm), fetch the newest copy of
its ranks that another node holds from the attempt just ended, checksums checked, and put it in
the node's tier as the ranks' own slots. Their vote then finds it as it finds any other snapshot,
and takes it only where every rank holds that step and storage has none newer."""

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from launcher.process.memory_tier import held_slots
from launcher.replicas.wire import WireError, connect, recv_crc, recv_file, recv_json, send_json

__all__ = ["Restored", "restore"]

_TIMEOUT_S = 10.0  # one holder's answers: one that does not answer is passed over


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    holder: int  # the node that held the copy
    source: int  # the node that sent it (the one lost)
    size: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Offer:
    holder: int
    address: str
    attempt: int
    step: int
    source: int


def needs_restore(tier: Path, first: int, count: int) -> bool:
    """None of the ranks holds a whole slot of its own."""
    return not any(first <= slot.rank < first + count for slot in held_slots(tier))


def restore(
    tier: Path,
    first: int,
    count: int,
    attempt: int,
    holders: List[Tuple[int, str]],
    go_on: Callable[[], bool] = lambda: True,
) -> Tuple[Optional[Restored], List[str]]:
    """(what was restored, or None; why each holder could not give it): the newest copy of the
    latest attempt up to ``attempt`` that made one (the one just ended, unless it ended before
    any copy; the ranks' vote decides whether it loads). At most ``_TIMEOUT_S`` a holder, and
    ``go_on()`` false (a signal) ends it between holders."""
    started = time.monotonic()
    problems: List[str] = []
    offers = []
    for holder, address in holders:
        if not go_on():
            return None, [*problems, "a signal came"]
        try:
            with connect(address, _TIMEOUT_S) as sock:
                send_json(sock, {"op": "newest", "first": first, "count": count, "attempt": attempt})
                copies = recv_json(sock).get("copies", [])
        except (OSError, WireError) as err:
            problems.append(f"node {holder}: {err}")
            continue
        offers += [
            _Offer(holder, address, int(c["attempt"]), int(c["step"]), int(c["source"])) for c in copies
        ]
    for offer in sorted(offers, key=lambda o: (o.attempt, o.step), reverse=True):
        if not go_on():
            return None, [*problems, "a signal came"]
        try:
            size = _fetch(tier, first, count, offer)
        except (OSError, WireError, ValueError) as err:
            problems.append(f"node {offer.holder}'s copy of step {offer.step}: {err}")
            continue
        return Restored(offer.step, offer.holder, offer.source, size, time.monotonic() - started), problems
    return None, problems


def _fetch(tier: Path, first: int, count: int, offer: _Offer) -> int:
    """Receive the copy into hidden files, checksums checked, then put each rank's data and index
    in place and its record last (slot 0: the node holds nothing else of these ranks)."""
    written: List[Tuple[Path, Path]] = []
    try:
        with connect(offer.address, _TIMEOUT_S) as sock:
            request = {
                "op": "get",
                "first": first,
                "count": count,
                "attempt": offer.attempt,
                "step": offer.step,
            }
            send_json(sock, request)
            answer = recv_json(sock)
            if not answer.get("found"):
                raise WireError("it no longer holds it")
            files = [(str(name), int(size)) for name, size in answer["files"]]
            for name, size in files:
                final = tier / _slot_name(name, first, count)
                hidden = final.with_name(f".restoring-{final.name}")
                written.append((hidden, final))
                with open(os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
                    got = recv_file(sock, out, size)
                sent = recv_crc(sock)
                if got != sent:
                    raise WireError(f"{name}: checksum {got:08x} received, {sent:08x} sent")
        records = [(h, f) for h, f in written if f.name.endswith(".json")]
        for hidden, _ in records:  # the rank's log and the summary say where it came from
            record = json.loads(hidden.read_text())
            hidden.write_text(
                json.dumps({**record, "origin": f"node {offer.holder}'s copy of node {offer.source}"})
            )
        for hidden, final in [*[(h, f) for h, f in written if not f.name.endswith(".json")], *records]:
            hidden.rename(final)
        return sum(size for _, size in files)
    finally:
        for hidden, _ in written:
            hidden.unlink(missing_ok=True)


def _slot_name(name: str, first: int, count: int) -> str:
    """A copy's file name (rank_<r>, .index, .json) as the tier's slot 0 of rank r."""
    base, dot, suffix = name.partition(".")
    rank = int(base.removeprefix("rank_"))
    if (
        not base.startswith("rank_")
        or not first <= rank < first + count
        or suffix not in ("", "index", "json")
    ):
        raise ValueError(f"a copy with an odd file: {name!r}")
    return f"rank_{rank}.0{dot}{suffix}"
