"""Watching heartbeats during an attempt: apply the deadlines, say who is behind, decide which
ranks are hung. It decides only: the process layer acts on it."""

import dataclasses
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from launcher.core.beats import BeatReading, OwnWork, Phase, ProgressRow
from launcher.core.config import HangSection
from launcher.core.events import (
    CheckpointLoaded,
    EventLog,
    FirstStep,
    Hang,
    HeartbeatDeadline,
    Laggard,
    OwnWorkNoted,
    Straggler,
)
from launcher.core.failures import Failure, HangFailure, seconds
from launcher.hangs.deadlines import HangLimits, HangWatch, Overdue
from launcher.hangs.stragglers import OwnWorkWindow, Slowdown, StragglerJudge, own_work_ratios
from worker_lib.core import contract as c

__all__ = ["HangMonitor", "hang_failures", "progress_rows"]

_LAGGARD_REPORT_EVERY_S = 10.0  # at most one "rank N is behind" report per this many seconds
_OWN_WORK_NOTED_EVERY_S = (15.0, 60.0)  # the attempt's first minute, later: a weekend's log stays small


class HangMonitor:
    """One per run: what it learns (that the script beats) carries over to the next attempt.
    With ``--heartbeat-timeout off`` it only notes milestones (loaded, first step)."""

    def __init__(
        self,
        hangs: HangSection,
        events: EventLog,
        say: Callable[[str], None],
        on_first_step: Callable[[], None] = lambda: None,
        known_to_beat: bool = False,
    ) -> None:
        """``known_to_beat``: an attempt of an earlier supervisor of this run saw a beat."""
        self._on_first_step = on_first_step
        self._judges = hangs.detects
        self._limits = HangLimits(
            hangs.init_timeout,
            hangs.heartbeat_timeout,
            hangs.heartbeat_floor,
            progress_timeout=hangs.progress_timeout,
        )
        self._events = events
        self._say = say
        self._known_to_beat = known_to_beat  # some rank of this run has called ft.heartbeat()
        self._said_never_beats = False
        self._next_laggard_report = 0.0
        self._reported_deadline: Optional[float] = None
        self._straggler_factor, self._window = hangs.straggler_factor, hangs.straggler_window
        self._work = OwnWorkWindow(self._window)
        self._judge = StragglerJudge(self._straggler_factor or 0.0)
        self._started = self._noted_due = 0.0

    def watch_attempt(self) -> HangWatch:
        """Deadlines for a group just started (auto learns afresh: the hardware may differ)."""
        self._reported_deadline = None
        self._work = OwnWorkWindow(self._window)
        self._judge = StragglerJudge(self._straggler_factor or 0.0)
        self._started = self._noted_due = time.monotonic()
        return HangWatch(self._limits, self._started, self._known_to_beat)

    def look_at_work(self, now: float, read: Callable[[], Mapping[int, OwnWork]]) -> None:
        """This node's ranks' own work (``read()``: their counters), sampled when due."""
        self._work.observe(now, read)

    def own_work(self) -> Dict[int, float]:
        """This node's ranks' own work a step over the window, where it is known."""
        return self._work.figures()

    def judge_stragglers(
        self, attempt: int, rows: List[ProgressRow], hosts: Mapping[Optional[int], str]
    ) -> None:
        """Where the run is held: every rank of the job (``rows``, with their own work) compared,
        the slow named and those back said; ``hosts``: node (None: the only one) → its host."""
        if self._straggler_factor is None:
            return
        changes = self._judge.judge(rows)
        now = time.monotonic()
        if changes or now >= self._noted_due:
            ratios = own_work_ratios(rows)
            if ratios:
                later = now - self._started >= 60
                self._noted_due = now + _OWN_WORK_NOTED_EVERY_S[later]
                self._events.emit(
                    OwnWorkNoted(attempt, {str(r): round(v, 3) for r, v in sorted(ratios.items())})
                )
        for change in changes:
            host = hosts.get(change.node, "")
            self._events.emit(
                Straggler(
                    attempt, change.rank, change.node, host, round(change.ratio, 3), self._window, change.back
                )
            )
            self._say(_slowdown_line(change, host, self._window))

    def check(
        self, watch: HangWatch, attempt: int, running: Mapping[int, int], slots: Dict[int, BeatReading]
    ) -> List[Overdue]:
        """The hung ranks, with those silent beside them (whose stacks show where the group stood);
        [] while all is well. ``running``: rank → pid of the group's live ranks."""
        readings = {rank: r for rank, r in slots.items() if rank in running}
        watch.observe(readings)
        self._known_to_beat = watch.known_to_beat
        self._note_milestones(watch, attempt, readings)
        if not self._judges:  # --heartbeat-timeout off: beats still time recoveries, never kill
            return []
        self._report_deadline(attempt, watch.step_deadline)
        now = time.monotonic()
        if watch.overdue(now, readings):
            return self._declare_hang(attempt, watch.silent_with(now, readings))
        self._report_laggards(attempt, now, watch.silences(now, readings), readings)
        if watch.never_beat(now) and not self._said_never_beats:
            self._said_never_beats = True
            self._say(
                f"no rank has called ft.heartbeat() within --init-timeout "
                f"({seconds(self._limits.init_timeout)} s): "
                "crashes are detected, hangs are not"
            )
        return []

    def _note_milestones(self, watch: HangWatch, attempt: int, readings: Dict[int, BeatReading]) -> None:
        """Every rank has loaded its checkpoint; every rank has stepped (where a recovery ends)."""
        if not readings:
            return
        if not watch.all_loaded and all(r.loaded_at > 0 for r in readings.values()):
            watch.all_loaded = True
            step, tier = _loaded_from(readings.values())
            self._events.emit(
                CheckpointLoaded(attempt, max(r.loaded_at for r in readings.values()), step, tier)
            )
            if tier:
                self._say(f"attempt {attempt}: every rank loaded step {step} from {tier}")
        if not watch.all_stepping and all(r.beats > 0 for r in readings.values()):
            watch.all_stepping = True
            self._events.emit(FirstStep(attempt))
            self._on_first_step()

    def _declare_hang(self, attempt: int, silent: List[Overdue]) -> List[Overdue]:
        for o in silent:
            self._events.emit(Hang(attempt, **dataclasses.asdict(o)))
        who = _who_hung(silent, self._limits.progress_timeout)
        self._say(f"attempt {attempt}: {who}; their stacks go to the logs")
        return silent

    def _report_deadline(self, attempt: int, now_in_force: Optional[float]) -> None:
        """Said when first learned and when it moves by half or more, not on every wiggle."""
        if self._limits.heartbeat_timeout is not None or now_in_force is None:
            return
        last = self._reported_deadline
        if last is None or not 0.67 < now_in_force / last < 1.5:
            self._reported_deadline = now_in_force
            self._events.emit(HeartbeatDeadline(attempt, now_in_force))
            self._say(f"heartbeat deadline now {seconds(now_in_force)} s (learned from the step interval)")

    def _report_laggards(
        self, attempt: int, now: float, silences: List[Overdue], readings: Dict[int, BeatReading]
    ) -> None:
        """A rank silent for over half its deadline is named, with where the others are."""
        behind = [s for s in silences if s.silent_for > s.deadline / 2]
        if not behind or now < self._next_laggard_report:
            return
        self._next_laggard_report = now + _LAGGARD_REPORT_EVERY_S
        for s in behind:
            self._events.emit(Laggard(attempt, **dataclasses.asdict(s)))
        named = ", ".join(
            f"rank {s.rank} silent {s.silent_for:.1f} s of {seconds(s.deadline)} s "
            f"({s.phase.value}, step {s.last_step})"
            for s in behind
        )
        steps = [r.step for r in readings.values() if r.beats]
        others = f"; all ranks at steps {min(steps)}..{max(steps)}" if steps else ""
        self._say(f"behind: {named}{others}")


def _slowdown_line(change: Slowdown, host: str, window: float) -> str:
    """ "behind: rank 5 on node 2 (host): its own work 1.9× the median for the last 30 s; every
    rank waits for it", or that it is back."""
    where = f" on node {change.node}" if change.node is not None else ""
    who = f"rank {change.rank}{where}" + (f" ({host})" if host else "")
    if change.back:
        return f"{who} is back to speed: its own work {change.ratio:.1f}× the median of the other ranks'"
    return (
        f"behind: {who}: its own work {change.ratio:.1f}× the median of the other ranks' "
        f"for the last {seconds(window)} s; every rank waits for it"
    )


def _who_hung(named: List[Overdue], progress_timeout: Optional[float]) -> str:
    """ "rank(s) 1 missed the heartbeat deadline (silent with them: rank(s) 2; beating at one step
    while they wait: rank(s) 0 at step 30)"."""

    def late(o: Overdue) -> bool:
        if o.stalled:
            return progress_timeout is not None and o.silent_for > progress_timeout
        return o.silent_for > o.deadline

    silent = [str(o.rank) for o in named if late(o) and not o.stalled]
    stalled = [f"{o.rank} at step {o.last_step}" for o in named if late(o) and o.stalled]
    words = [f"rank(s) {', '.join(silent)} missed the heartbeat deadline"] if silent else []
    words += (
        [f"rank(s) {', '.join(stalled)} beat without a new step past --progress-timeout"] if stalled else []
    )
    with_them = [str(o.rank) for o in named if not late(o) and not o.stalled]
    in_place = [f"{o.rank} at step {o.last_step}" for o in named if not late(o) and o.stalled]
    also = [f"silent with them: rank(s) {', '.join(with_them)}"] if with_them else []
    also += [f"beating at one step while they wait: rank(s) {', '.join(in_place)}"] if in_place else []
    return "; ".join(words) + (f" ({'; '.join(also)})" if also else "")


def hang_failures(
    silent: List[Overdue],
    running: Mapping[int, int],
    readings: Mapping[int, BeatReading],
    where: Mapping[int, Tuple[int, Path]],
    statuses: Mapping[int, str],
) -> List[Failure]:
    """The decision as failures. ``where``: rank → (local rank, log file); ``statuses``: rank →
    its process's state once the stacks were asked for ("stopped" is the evidence of a SIGSTOP)."""
    return [
        HangFailure(
            rank=o.rank,
            local_rank=where[o.rank][0],
            pid=running[o.rank],
            phase=o.phase,
            silent_for=o.silent_for,
            deadline=o.deadline,
            last_step=o.last_step,
            observed_at=o.silent_since,
            log_file=where[o.rank][1],
            thread_id=readings[o.rank].main_thread,
            process_status=statuses.get(o.rank, ""),
            stalled=o.stalled,
            collective=readings[o.rank].collective,
        )
        for o in silent
    ]


def progress_rows(
    slots: Dict[int, BeatReading], running: Dict[int, int], now: float, own_work: Mapping[int, float] = {}
) -> List[ProgressRow]:
    """Each running rank's step, beat age and own work, as ``ftlaunch status`` shows them."""
    rows = []
    for rank, pid in sorted(running.items()):
        r = slots.get(rank)
        phase = r.phase if r is not None else Phase.STARTING
        rows.append(
            ProgressRow(
                rank=rank,
                pid=pid,
                step=r.step if r is not None and r.beats > 0 else None,
                silent_for=round(now - r.active_at, 3) if r is not None and r.active_at else None,
                phase=phase.value,
                own_work=own_work.get(rank),
            )
        )
    return rows


def _loaded_from(readings) -> Tuple[Optional[int], str]:
    """The step every rank loaded and the tier it came from, when they all say the same."""
    seen = {(r.loaded_step, r.loaded_tier) for r in readings}
    if len(seen) != 1:
        return None, ""
    ((step, tier),) = seen
    return (step, c.TIER_NAMES[tier]) if tier in c.TIER_NAMES and step >= 0 else (None, "")
