"""``ftlaunch status RUN --plot FILE``: the picture of a real run with a crash, read back: its
lines are the run's Steps events, its marks the run's failures and loads, its title the goodput
the run's own summary gave."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SCRIPTS

from launcher.core.events import AttemptEnded, FirstStep, RunStart, Steps, Transition
from launcher.observe.plot import draw_run, node_events
from launcher.runs.directory import RunDir

OBSERVED = str(SCRIPTS / "observed.py")
pytestmark = pytest.mark.timeout(300)  # the first test starts the run it draws


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher", "status", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """One run, drawn by every test here: rank 1 SIGKILLed at step 12, resumed, done at 40."""
    from helpers import Launcher

    tmp_path = tmp_path_factory.mktemp("plotted")
    release = tmp_path / "release"
    release.touch()  # the last attempt does not wait
    launcher = Launcher(tmp_path)
    launch = launcher.run("--nproc", "2", OBSERVED, "--release", str(release), timeout=240)
    leaked = launcher.cleanup()
    assert launch.proc.returncode == 0, launch.stderr
    assert not leaked, leaked
    return launch


def test_the_picture_draws_every_attempts_steps_the_failure_and_the_runs_goodput(crashed_run, tmp_path):
    url = crashed_run.run_url()
    events = RunDir(url).read_events()
    nodes = node_events(events, None)
    figure = draw_run("the run", nodes)
    t0 = min(e.t_wall for e in events)
    axes = figure.axes[0]
    drawn = {line.get_gid(): line for line in axes.get_lines() if (line.get_gid() or "").startswith("steps/")}
    steps = [e for e in events if isinstance(e.event, Steps)]
    assert sorted(drawn) == ["steps/node0/attempt0", "steps/node0/attempt1"]
    for attempt in (0, 1):
        mine = [e for e in steps if e.event.attempt == attempt]
        line = drawn[f"steps/node0/attempt{attempt}"]
        assert list(line.get_xdata()) == [e.t_wall - t0 for e in mine]
        assert list(line.get_ydata()) == [e.event.step for e in mine]
    assert drawn["steps/node0/attempt1"].get_ydata()[-1] == 40
    crash = next(e for e in events if isinstance(e.event, AttemptEnded) and e.event.outcome == "FAILED")
    texts = [t.get_text() for t in axes.texts]
    assert "crash rank 1" in texts
    assert any(re.fullmatch(r"step \d+ from (memory|storage)", t) for t in texts)
    failure = [line for line in axes.get_lines() if line.get_label() == "failure"]
    # Marked at the crash, at the step the run recorded last: the slowest rank's. Rank 1 beat 12
    # and died before its snapshot of 12; it had snapshot 10 only once every rank shared 8 (the
    # memory tier's vote), so rank 0 was at 8-12 (CI once drew 11: the test had bet on 12).
    last_recorded = [e.event.step for e in steps if e.event.attempt == 0][-1]
    assert [(list(f.get_xdata()), list(f.get_ydata())) for f in failure] == [
        ([crash.t_wall - t0], [last_recorded])
    ]
    assert 8 <= last_recorded <= 12
    spans = {patch.get_label(): (patch.get_x(), patch.get_x() + patch.get_width()) for patch in axes.patches}
    started = next(e for e in events if isinstance(e.event, RunStart))
    first_steps = [e for e in events if isinstance(e.event, FirstStep)]
    failed = next(e for e in events if isinstance(e.event, Transition) and e.event.new.value == "FAILED")
    assert spans["start-up (to the first step)"] == pytest.approx(
        (started.t_wall - t0, first_steps[0].t_wall - t0), abs=1e-9
    )
    assert spans["down (failure to first step)"] == pytest.approx(
        (failed.t_wall - t0, first_steps[1].t_wall - t0), abs=1e-9
    )
    said = int(re.search(r"goodput (\d+)%", crashed_run.stderr).group(1))
    drawn_goodput = int(re.search(r"goodput (\d+)%", axes.get_title()).group(1))
    assert abs(drawn_goodput - said) <= 1  # the same rule, a few ms later
    figure.savefig(tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_status_plot_writes_png_and_svg_and_refuses_another_format(crashed_run, tmp_path):
    url = crashed_run.run_url()
    done = _status(url, "--plot", str(tmp_path / "run.png"))
    assert done.returncode == 0, done.stderr
    assert "status       SUCCEEDED" in done.stdout  # the table too
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = _status(url, "--plot", str(tmp_path / "run.svg"))
    assert done.returncode == 0 and "<svg" in (tmp_path / "run.svg").read_text()
    done = _status(url, "--plot", str(tmp_path / "run.jpg"))
    assert done.returncode == 2 and "--plot writes .png or .svg files, not run.jpg" in done.stderr
    done = _status(url, "--plot", str(tmp_path / "missing" / "run.png"))
    assert done.returncode == 2 and "--plot: cannot write" in done.stderr


def test_a_relaunch_that_starts_nothing_leaves_the_run_and_its_picture_as_they_were(
    crashed_run, launcher, tmp_path
):
    """Issue 48: the same command once the run had succeeded appended its own events to the run's
    (the picture, whose goodput runs to the last event, fell from 69% to 5%) and rewrote run.json;
    and a run dir copied elsewhere was said to be at its old URL."""
    copied = tmp_path / "copied" / Path(crashed_run.run_url()).name
    shutil.copytree(crashed_run.run_url(), copied)
    before = {name: (copied / name).read_bytes() for name in ("run.json", "events.jsonl")}
    title = _title(copied)
    config = RunDir(str(copied)).read_state().config
    command = ["--nproc", str(config["nproc"]), config["entrypoint"], *config["script_args"]]
    again = launcher.run("--run-dir", str(copied.parent), *command)
    assert again.proc.returncode == 0, again.stderr
    assert f"[ftlaunch] run {copied} had already succeeded (" in again.stderr
    assert {name: (copied / name).read_bytes() for name in before} == before
    assert _title(copied) == title and re.search(r"goodput \d+%", title)
    shown = _status(str(copied), "--plot", str(tmp_path / "run.png"))
    assert shown.returncode == 0 and "status       SUCCEEDED (every rank exited 0)" in shown.stdout
    assert again.survivors() == []


def _title(run: Path) -> str:
    """The picture's title, as `status --plot` draws it."""
    figure = draw_run(run.name, node_events(RunDir(str(run)).read_events(), None))
    return figure.axes[0].get_title()
