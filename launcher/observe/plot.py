"""``ftlaunch status RUN --plot FILE.png|.svg``: the run's timeline from its events alone: the
step over wall time per node and attempt, failures marked, each recovery's downtime shaded,
goodput in the title. Other nodes' events come from ``<log dir>/node<R>/events.jsonl`` where this
machine sees them. matplotlib is an optional extra, imported only here.
"""

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher.core.events import (
    AttemptEnded,
    CheckpointLoaded,
    Event,
    FirstStep,
    Logged,
    NodeReplaced,
    RunStart,
    Steps,
    Straggler,
    Transition,
    first_of,
    of_kind,
    parse_logged,
)
from launcher.core.group_state import GroupState
from launcher.core.outcomes import AttemptOutcome
from launcher.grammar.errors import UsageError
from launcher.observe.metrics import RunMetrics

__all__ = ["FORMATS", "NodeEvents", "draw_run", "node_events"]

FORMATS = (".png", ".svg")
_FAILED = (GroupState.FAILED, GroupState.HUNG)
_NODE_COLOURS = (
    "tab:blue",
    "tab:green",
    "tab:purple",
    "tab:brown",
    "tab:olive",
    "tab:cyan",
    "tab:pink",
    "tab:gray",
)


@dataclasses.dataclass(frozen=True)
class NodeEvents:
    node: int
    events: Sequence[Logged[Event]]


def node_events(run_events: Sequence[Logged[Event]], log_dir: Optional[str]) -> List[NodeEvents]:
    """Node 0's events (the run's log) and every other node's that this machine can read."""
    found = [NodeEvents(0, run_events)]
    folder = Path(log_dir) if log_dir else None
    if folder is None or not folder.name.startswith("node"):  # one node: its log is the run's
        return found
    for path in folder.parent.glob("node*/events.jsonl"):
        rank = path.parent.name[len("node") :]
        if rank.isdigit() and int(rank) != 0:
            found.append(NodeEvents(int(rank), _read(path)))
    return sorted(found, key=lambda n: n.node)


def draw_run(title: str, nodes: Sequence[NodeEvents], now: Optional[float] = None):
    """The picture, as a matplotlib Figure (not yet saved): its lines carry ``gid``
    ``steps/node<R>/attempt<K>``, x in seconds since the run's first event, y the step."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ftlaunch[plot]'") from None
    every = [e for n in nodes for e in n.events]
    if not every:
        raise UsageError("--plot: the run has no events to draw")
    t0 = min(e.t_wall for e in every)
    figure = Figure(figsize=(11, 5.5), layout="constrained")
    axes = figure.add_subplot()
    for n in nodes:
        colour = _NODE_COLOURS[n.node % len(_NODE_COLOURS)]
        _draw_node(axes, n, t0, colour, many=len(nodes) > 1)
    axes.set_xlim(left=0)  # from the run's first event: start-up is time too
    axes.set_title(f"{title}: {_goodput_words(nodes[0].events, now)}")
    axes.set_xlabel(f"time since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))}")
    axes.set_ylabel("step (every rank of the node)")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _clock(x)))
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if handles:
        unique = dict(zip(labels, handles))
        axes.legend(unique.values(), unique.keys(), loc="upper left", fontsize="small")
    return figure


def _draw_node(axes, n: NodeEvents, t0: float, colour: str, many: bool) -> None:
    who = f"node {n.node}" if many else "steps"
    for attempt, steps in sorted(_steps_by_attempt(n.events).items()):
        xs = [s.t_wall - t0 for s in steps]
        ys = [s.event.step for s in steps]
        axes.plot(xs, ys, color=colour, marker=".", gid=f"steps/node{n.node}/attempt{attempt}", label=who)
    if n.node != 0 and many:
        return  # the job's failures, recoveries and loads are node 0's to tell
    for start, end in _start_ups(n.events):
        axes.axvspan(
            start - t0, end - t0, color="tab:gray", alpha=0.12, lw=0, label="start-up (to the first step)"
        )
    for start, end in _downtimes(n.events):
        axes.axvspan(
            start - t0, end - t0, color="tab:red", alpha=0.15, lw=0, label="down (failure to first step)"
        )
    last_step = _last_steps(n.events)
    for ended in of_kind(n.events, AttemptEnded):
        _mark_end(axes, ended, last_step.get(ended.event.attempt, 0), t0)
    for took in of_kind(n.events, NodeReplaced):  # --standby-nodes: which node took whose place
        e, x, y = took.event, took.t_wall - t0, last_step.get(took.event.attempt - 1, 0)
        axes.plot([x], [y], "^", color="tab:blue", ms=8, gid=f"replaced/attempt{e.attempt}", label="standby")
        words = f"node {e.node} took node {e.replaced}'s place"
        axes.annotate(
            words, (x, y), textcoords="offset points", xytext=(4, -12), fontsize="small", color="tab:blue"
        )
    for start, end, named in _slow_spans(n.events):  # the stragglers, from their name to back
        gid = f"straggler/attempt{named.attempt}/rank{named.rank}"
        axes.axvspan(start - t0, end - t0, color="tab:orange", alpha=0.12, lw=0, gid=gid, label="a rank slow")
        axes.annotate(
            f"rank {named.rank} slow ({named.ratio:.1f}×)",
            (start - t0, last_step.get(named.attempt, 0)),
            textcoords="offset points",
            xytext=(4, -24),
            fontsize="small",
            color="tab:orange",
        )
    for loaded in (e for e in of_kind(n.events, CheckpointLoaded) if e.event.tier):
        axes.annotate(
            f"step {loaded.event.step} from {loaded.event.tier}",
            (loaded.t_wall - t0, loaded.event.step or 0),
            textcoords="offset points",
            xytext=(4, 8),
            fontsize="x-small",
            color="tab:gray",
        )


def _mark_end(axes, ended: Logged[AttemptEnded], step: int, t0: float) -> None:
    e = ended.event
    if e.outcome == AttemptOutcome.FAILED.value:
        kind = {"crash": "crash", "hang": "hang", "lost_node": "lost node"}.get(e.cause, "failure")
        who = f"node {e.node}" if e.cause == "lost_node" else f"rank {e.rank}" if e.rank is not None else ""
        words = f"{kind} {who}".strip() + (" (chaos)" if e.injected else "")
        axes.plot([ended.t_wall - t0], [step], "x", color="tab:red", ms=9, mew=2, label="failure")
        axes.annotate(
            words,
            (ended.t_wall - t0, step),
            textcoords="offset points",
            xytext=(-6, 6),
            ha="right",
            fontsize="small",
            color="tab:red",
        )
    elif e.outcome == AttemptOutcome.SUCCEEDED.value:
        axes.plot([ended.t_wall - t0], [step], "o", color="tab:green", ms=7, label="succeeded")
    else:  # preempted, resized, interrupted: the run stopped or changed, nothing failed
        axes.plot([ended.t_wall - t0], [step], "v", color="tab:orange", ms=8, label=e.outcome.lower())


def _slow_spans(events: Sequence[Logged[Event]]) -> List[Tuple[float, float, Straggler]]:
    """Each rank named slow: (named, back or its attempt's end or the last event, the naming)."""
    ends = {e.event.attempt: e.t_wall for e in of_kind(events, AttemptEnded)}
    last = max(e.t_wall for e in events)
    spans: List[Tuple[float, float, Straggler]] = []
    open_: Dict[Tuple[int, int], Logged[Straggler]] = {}
    for e in of_kind(events, Straggler):
        key = (e.event.attempt, e.event.rank)
        if not e.event.back:
            open_.setdefault(key, e)
        elif key in open_:
            named = open_.pop(key)
            spans.append((named.t_wall, e.t_wall, named.event))
    spans += [(n.t_wall, ends.get(n.event.attempt, last), n.event) for n in open_.values()]
    return spans


def _steps_by_attempt(events: Sequence[Logged[Event]]) -> Dict[int, List[Logged[Steps]]]:
    found: Dict[int, List[Logged[Steps]]] = {}
    for e in of_kind(events, Steps):
        found.setdefault(e.event.attempt, []).append(e)
    return found


def _last_steps(events: Sequence[Logged[Event]]) -> Dict[int, int]:
    return {attempt: steps[-1].event.step for attempt, steps in _steps_by_attempt(events).items()}


def _downtimes(events: Sequence[Logged[Event]]) -> List[Tuple[float, float]]:
    """Wall-clock spans from each failure to the next attempt's first step (or its start, when it
    never beat); a failure that ended the run has no recovery."""
    spans = []
    for failed in (e for e in of_kind(events, Transition) if e.event.new in _FAILED):
        after = [e for e in events if e.attempt == failed.event.attempt + 1]
        first: Optional[Logged[Any]] = first_of(after, FirstStep)
        running = next((e for e in of_kind(after, Transition) if e.event.new is GroupState.RUNNING), None)
        if running is not None:  # a recovery (not the run's end)
            spans.append((failed.t_wall, (first or running).t_wall))
    return spans


def _start_ups(events: Sequence[Logged[Event]]) -> List[Tuple[float, float]]:
    """From each supervisor's start to its first attempt's first step: imports, data, the load."""
    spans = []
    for start in (e for e in events if isinstance(e.event, RunStart)):
        first = next((e for e in events if e.t_wall >= start.t_wall and isinstance(e.event, FirstStep)), None)
        if first is not None:
            spans.append((start.t_wall, first.t_wall))
    return spans


def _goodput_words(events: Sequence[Logged[Event]], now: Optional[float]) -> str:
    metrics = RunMetrics()
    for e in events:
        metrics.fold(e)
    value = metrics.goodput(now if now is not None else events[-1].t_wall)
    return "goodput unknown" if value != value else f"goodput {value:.0%}"


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}"
    return f"{minutes}m{secs:02d}" if minutes else f"{secs}s"


def _read(path: Path) -> List[Logged[Event]]:
    """A node's own events.jsonl; unreadable lines are skipped."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            logged = parse_logged(json.loads(line))
        except ValueError:
            logged = None
        if logged is not None:
            found.append(logged)
    return found
