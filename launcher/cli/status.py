"""``ftlaunch status [RUN] [--run-dir URL] [--json]``: what a run is doing or did.

Reads only the run directory (run.json, lock.json, progress.json, events.jsonl for --plot) and the
checkpoints' commit markers, so it works from any machine that can reach the storage, while the
run is live or long after. A damaged file is said naming it, never a traceback.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import click

from launcher.cli.environment import PET_PREFIX
from launcher.core.beats import LiveProgress
from launcher.core.config import join_run_url
from launcher.core.failures import seconds
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.records import AttemptEntry, RunState
from launcher.grammar.errors import UsageError
from launcher.hangs.stragglers import own_work_ratios
from launcher.runs.checkpoints import CheckpointDir
from launcher.runs.directory import Damaged, LockState, RunDir

__all__ = ["status", "run_status"]

# Where the launch's --run-dir is read from below the command line, in its order: status finds the
# runs that a script's exported FTLAUNCH_RUN_DIR (scripts/ftlaunch_sbatch.sh) put there.
RUN_DIR_VARIABLES = ("FTLAUNCH_RUN_DIR", f"{PET_PREFIX}RUN_DIR")


@click.command(name="status")
@click.argument("run", required=False)
@click.option(
    "--run-dir",
    default="ftlaunch_runs",
    envvar=list(RUN_DIR_VARIABLES),
    show_envvar=True,
    metavar="URL",
    help="Where runs live (as the launch's --run-dir)  [default: ftlaunch_runs]",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE.png|FILE.svg",
    help="Also draw RUN's timeline into FILE: the step of every attempt over time, failures, downtime, "
    "goodput (needs matplotlib: pip install 'ftlaunch[plot]').",
)
def status(run: Optional[str], run_dir: str, as_json: bool, plot: Optional[Path]) -> int:
    """Show RUN (a name under --run-dir, or a run's path or URL); without RUN, list the runs."""
    from worker_lib.core.storage import StorageError

    where = run_dir if run is None else run
    try:
        if run is None:
            if plot is not None:
                raise UsageError("--plot draws one run: name it (ftlaunch status RUN --plot FILE)")
            return _list_runs(run_dir, as_json)
        url = run if ("/" in run or "://" in run) else join_run_url(run_dir, run)
        report = run_status(url)
        if plot is not None:
            _plot(report, plot)
        if as_json:
            progress = report["progress"] and report["progress"].to_json()
            plain = {**report, "run": report["run"].to_json(), "progress": progress}
            click.echo(json.dumps(plain, indent=1, default=str))
        else:
            click.echo("\n".join(_table(report)))
        return 0
    except BrokenPipeError:  # `ftlaunch status | head`: the reader has what it wanted
        return _reader_gone()
    except (StorageError, OSError) as err:  # a malformed URL, a file where a folder should be, ...
        raise UsageError(f"cannot read {where}: {err}") from None


def _plot(report: Dict[str, Any], path: Path) -> None:
    """The run's picture, from its events (and other nodes' logs this machine sees)."""
    from launcher.observe.plot import FORMATS, draw_run, node_events

    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"--plot writes {' or '.join(FORMATS)} files, not {path.name}")
    state: RunState = report["run"]
    log_dir = state.config.get("log_dir") if isinstance(state.config, dict) else None
    nodes = node_events(RunDir(report["url"]).read_events(), log_dir)
    name = report["url"].rstrip("/").rsplit("/", 1)[-1]
    figure = draw_run(name, nodes, report["now"] if report["live"] else None)
    try:
        figure.savefig(path)
    except OSError as err:
        raise UsageError(f"--plot: cannot write {path}: {err.strerror or err}") from None


def _reader_gone() -> int:
    """Standard output's reader left: say nothing more (not even at exit, when Python flushes)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0


def run_status(url: str) -> Dict[str, Any]:
    """The run's state, whether a supervisor holds it now, and its ranks' progress if so."""
    run = RunDir(url)
    state = run.read_state()
    if state is None:
        raise UsageError(f"no run at {url} (no run.json)")
    now = time.time()
    holder = run.read_lock()
    judged = holder.judge(now) if holder is not None else None
    live = judged is LockState.ALIVE
    if state.status is RunStatus.RUNNING:  # workers commit while it runs: storage is newer than run.json
        size = int(state.config.get("nproc") or 1) * int(state.config.get("nnodes") or 1)
        if state.attempts and state.attempts[-1].world_size:  # an elastic job's size now
            size = state.attempts[-1].world_size
        newest = CheckpointDir(state.config.get("checkpoint_url"), size).newest()
        if newest.known:
            state.latest_step, state.latest_step_at = newest.step, newest.committed_at
    return {
        "url": url,
        "live": live,
        "holder": holder.describe(now) if holder is not None else None,
        "holder_state": judged.value if judged is not None else None,
        "now": now,
        "run": state,
        "progress": _progress(run) if live else None,
    }


def _progress(run: RunDir) -> Optional[LiveProgress]:
    """The live ranks; a damaged progress.json is said and left out (the rest stands without it)."""
    try:
        return run.read_progress()
    except Damaged as err:
        click.echo(f"ftlaunch status: {err}; its ranks are not shown (its supervisor rewrites it)", err=True)
        return None


def _list_runs(run_dir: str, as_json: bool) -> int:
    from worker_lib.core.storage import Storage, StorageError

    base = Storage(join_run_url(run_dir, ""), label="run dir")
    if base.fs.exists(base.root) and not base.fs.isdir(base.root):
        raise UsageError(f"--run-dir {run_dir} is a file, not a folder of runs")
    rows: List[Dict[str, Any]] = []
    for name in sorted(base.list_names()):
        if not base.fs.isdir(base.path(name)):
            continue  # a stray file
        try:
            run = RunDir(join_run_url(run_dir, name)).read_state()
        except UsageError:  # a run.json that cannot be read as a run's state: shown, not hidden
            rows.append({"name": name, "status": "DAMAGED", "attempts": None, "latest_step": None})
            continue
        except StorageError:  # unreadable: not a run of ours
            continue
        if run is not None:
            rows.append(
                {
                    "name": name,
                    "status": run.status.value,
                    "attempts": len(run.attempts),
                    "latest_step": run.latest_step,
                }
            )
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    elif not rows:
        click.echo(f"no runs under {run_dir}")
    else:
        click.echo(f"{'run':<24} {'status':<10} {'attempts':>8} {'latest step':>12}")
        for r in rows:
            step = "-" if r["latest_step"] is None else r["latest_step"]
            attempts = "-" if r["attempts"] is None else r["attempts"]
            click.echo(f"{r['name']:<24} {r['status']:<10} {attempts:>8} {step:>12}")
    return 0


def _table(report: Dict[str, Any]) -> List[str]:
    state: RunState = report["run"]
    now = report["now"]
    attempts = state.attempts
    many = any(a.nodes for a in attempts)
    failed = [a for a in attempts if a.outcome is AttemptOutcome.FAILED]
    others = (
        AttemptOutcome.PREEMPTED,
        AttemptOutcome.INTERRUPTED,
        AttemptOutcome.SUPERVISOR_LOST,
        AttemptOutcome.RESIZED,
        AttemptOutcome.NODE_LOST,
    )
    apart = "".join(
        f", {state.count(o)} {o.value.lower().replace('_', ' ')}" for o in others if state.count(o)
    )
    causes: Dict[str, int] = {}
    for a in failed:
        for f in a.failures[:1]:
            causes[f.cause.value] = causes.get(f.cause.value, 0) + 1
    status = state.status.value
    if report["live"]:
        status += f", held by {report['holder']}"
    elif state.status is RunStatus.RUNNING:  # its supervisor was killed: nothing runs it now
        gone = (
            f"its supervisor {report['holder']} is {report['holder_state']}"
            if report["holder"]
            else "no supervisor holds it"
        )
        status += f", but {gone}: run the same command to resume it"
    if state.reason:
        status += f" ({state.reason})"
    lines = [
        f"run          {report['url']}",
        f"status       {status}",
        f"attempts     {len(attempts)}, {len(failed)} failed"
        + (f" ({', '.join(f'{n} {c}' for c, n in sorted(causes.items()))})" if causes else "")
        + apart,
        f"checkpoint   {_checkpoint(state, now)}",
        *([f"chaos        {state.config['chaos']} (faults injected on purpose)"] if _chaos(state) else []),
        "",
        f"{'attempt':>7}  {'started':<19}  {'ran':>8}  {'outcome':<16}  {'from step':>9}  {'progress':<8}  "
        + (f"{'nodes (ranks)':<16}  " if many else "")
        + "first failure",
    ]
    for a in attempts:
        ran = seconds((a.ended_at or now) - a.started_at) + " s"
        first = a.failures[0].detail if a.failures else ""
        step = "-" if a.resumed_from_step is None else a.resumed_from_step
        outcome = a.outcome.value if a.outcome is not None else "running"
        progress = a.progress.value if a.outcome is not None else ""
        lines.append(
            f"{a.attempt:>7}  {_when(a.started_at):<19}  {ran:>8}  {outcome:<16}  {step:>9}  "
            f"{progress:<8}  " + (f"{_nodes(a):<16}  " if many else "") + first
        )
    resized = [a for a in attempts if a.resize]
    if resized:
        lines += ["", "resizes (--nnodes MIN:MAX):"] + [f"  attempt {a.attempt}: {a.resize}" for a in resized]
    replaced = [a for a in attempts if a.replaced]
    if replaced:
        lines += ["", "standby nodes that took a place:"]
        lines += [f"  attempt {a.attempt}: {a.replaced}" for a in replaced]
    live: Optional[LiveProgress] = report.get("progress")
    if attempts and attempts[-1].nodes and not (live and live.nodes):
        lines += [
            "",
            f"nodes of attempt {attempts[-1].attempt}: "
            + ", ".join(
                f"node {n['node']} on {n['host']} (supervisor pid {n['pid']})" for n in attempts[-1].nodes
            ),
        ]
    if live:
        lines += _progress_lines(live, now)
    return lines


def _nodes(attempt: AttemptEntry) -> str:
    """'0,2 (4)': the node ranks that held an attempt and its ranks in all; '+3' a standby."""
    nodes = ",".join(str(n["node"]) for n in attempt.nodes if not n.get("standby"))
    nodes += "".join(f"+{n['node']}" for n in attempt.nodes if n.get("standby"))
    return f"{nodes} ({attempt.world_size})" if attempt.world_size else nodes


def _chaos(state: RunState) -> bool:
    return isinstance(state.config, dict) and bool(state.config.get("chaos"))


def _progress_lines(progress: LiveProgress, now: float) -> List[str]:
    """The live attempt: each node's supervisor (with many nodes) and each rank's step."""
    age = now - progress.written_at
    lines = []
    if progress.nodes:
        lines += ["", f"nodes of attempt {progress.attempt} (as of {age:.0f} s ago):"]
        copies = any(n.copied is not None for n in progress.nodes)  # --memory-peers
        lines.append(
            f"{'node':>5}  {'host':<20}  {'pid':>7}  {'last seen':<12}"
            + ("  copied on peers" if copies else "")
        )
        for n in progress.nodes:
            seen = "lost" if n.lost else f"{n.silent_for + age:.1f} s ago"
            copied = (
                f"  step {n.copied}, {n.copy_lag} behind" if n.copied is not None else "  -" if copies else ""
            )
            lines.append(f"{n.node:>5}  {n.host or '?':<20}  {n.pid or '?':>7}  {seen:<12}{copied}".rstrip())
    ranks = progress.ranks
    many = any(r.node is not None for r in ranks)
    ratios = own_work_ratios(ranks)
    lines += ["", f"ranks of attempt {progress.attempt} (as of {age:.0f} s ago):"]
    lines.append(
        ("node  " if many else "")
        + f"{'rank':>5}  {'pid':>7}  {'step':>8}  {'last beat':>10}  {'phase':<8}  own work a step"
    )
    for r in ranks:
        beat = "-" if r.silent_for is None else f"{r.silent_for + age:.1f} s ago"
        step = "-" if r.step is None else r.step
        node = f"{'-' if r.node is None else r.node:>4}  " if many else ""
        own = "-" if r.own_work is None else f"{r.own_work:.3f} s"
        own += f" ({ratios[r.rank]:.1f}× the others')" if r.rank in ratios else ""
        lines.append(f"{node}{r.rank:>5}  {r.pid:>7}  {step:>8}  {beat:>10}  {r.phase:<8}  {own}")
    return lines


def _checkpoint(state: RunState, now: float) -> str:
    if state.latest_step is None:
        return "none committed"
    at = state.latest_step_at
    age = f", committed {seconds(now - at)} s ago" if at else ""
    return f"step {state.latest_step}{age}"


def _when(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
