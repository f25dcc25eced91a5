"""The run's metrics seen from outside (issue 36): scraped by a real Prometheus from a run with a
crash and a hang, written to a file for node_exporter's textfile collector, refused before any
worker starts when the port is busy, and never in the supervisor's way."""

import math
import re
import shutil
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import ACTOR, SCRIPTS, read_logged, wait_for_files
from prometheus_client.parser import text_string_to_metric_families
from prometheus_server import Prometheus, why_not_here

from launcher.core.events import AttemptEnded, CheckpointTotals, Hang, Steps, Transition
from launcher.core.recovery import recoveries
from launcher.observe.plot import draw_run, node_events
from launcher.runs.directory import RunDir

pytestmark = pytest.mark.exec_workers  # what is measured and served, not how the workers start

OBSERVED = str(SCRIPTS / "observed.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _expected(log: Path) -> dict:
    """What the run's own events say, counted here, as PromQL expression → value."""
    logged = read_logged(log)
    events = [e.event for e in logged]
    ended = [e for e in events if isinstance(e, AttemptEnded)]
    newest = {}
    for e in events:
        if isinstance(e, CheckpointTotals):
            newest[e.attempt] = e  # each attempt's newest
    totals = list(newest.values())
    steps = [e for e in events if isinstance(e, Steps)]
    expected = {
        "ftlaunch_attempts_total": sum(isinstance(e, Transition) and e.old is None for e in events),
        "ftlaunch_restarts_total": sum(e.restarting for e in ended),
        "ftlaunch_hangs_detected_total": sum(type(e) is Hang for e in events),
        "ftlaunch_downtime_seconds_total": sum(r.downtime for r in recoveries(logged)),
        "ftlaunch_step": steps[-1].step if steps else math.nan,
        "ftlaunch_checkpoint_commit_seconds_count": sum(t.commits for t in totals),
    }
    for tier in ("memory", "storage"):
        expected[f'ftlaunch_checkpoint_save_seconds_count{{tier="{tier}"}}'] = sum(
            getattr(t, f"saves_{tier}") for t in totals
        )
        expected[f'ftlaunch_checkpoint_load_seconds_count{{tier="{tier}"}}'] = sum(
            getattr(t, f"loads_{tier}") for t in totals
        )
    for kind in ("crash", "hang", "lost_node", "unknown"):
        count = sum(e.outcome == "FAILED" and e.cause == kind for e in ended)
        expected[f'ftlaunch_failures_total{{kind="{kind}"}}'] = count
    return expected


@pytest.fixture(scope="module")
def prometheus_here():
    reason = why_not_here()
    if reason:
        pytest.skip(reason)


@pytest.mark.timeout(420)
def test_a_real_prometheus_scrapes_a_run_with_a_crash_and_a_hang_and_reads_what_its_events_say(
    launcher, tmp_path, prometheus_here
):
    port, release = _free_port(), tmp_path / "release"
    server = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"])
    try:
        launch = launcher.start(
            "--nproc", "2", "--metrics-port", str(port), "--heartbeat-timeout", "2s",
            OBSERVED, "--hang-at", "20", "--release", str(release),
        )  # fmt: skip
        # The last attempt holds still at its last step, beating: the values stop moving.
        launch.wait_for_event(Steps, lambda e: e.attempt == 2 and e.step == 40, timeout=300)
        deadline, seen = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            expected = _expected(launch.log_dir / "events.jsonl")
            seen = {expr: server.value(expr) for expr in expected}
            if seen == expected:
                break
            time.sleep(0.5)
        assert seen == expected
        # What the run was made to do, seen from Prometheus: one crash, one hang, two restarts.
        assert seen['ftlaunch_failures_total{kind="crash"}'] == 1
        assert seen['ftlaunch_failures_total{kind="hang"}'] == 1
        assert seen["ftlaunch_restarts_total"] == 2 and seen["ftlaunch_attempts_total"] == 3
        assert seen["ftlaunch_downtime_seconds_total"] > 0
        assert seen['ftlaunch_checkpoint_load_seconds_count{tier="memory"}'] >= 2  # both recoveries
        assert server.value("ftlaunch_group_running") == 1
        assert server.value("ftlaunch_world_size") == 2 and server.value("ftlaunch_nodes") == 1
        assert 0 < server.value("ftlaunch_goodput_ratio") < 1  # worker_lib commits: goodput is known
        assert server.value("ftlaunch_step_age_seconds") >= 0
        labels = server.query("ftlaunch_attempts_total")[0]["metric"]
    finally:
        release.touch()
        server.stop()
    assert launch.wait(120) == 0, launch.stderr
    assert (labels["node"], labels["run"]) == ("0", launch.run_url().rsplit("/", 1)[1])
    # worker_lib's own counts, exactly: the last attempt resumed at step r, snapshotted every even
    # step and saved every fifth up to 40, on both ranks; rank 0 committed each fifth; both loaded.
    (r,) = set(re.findall(r"attempt 2 starts at step (\d+)", launch.stdout))
    steps = range(int(r) + 1, 41)
    last = [e for e in launch.events(CheckpointTotals) if e.attempt == 2][-1]
    fifths = sum(s % 5 == 0 for s in steps)
    assert (last.saves_memory, last.saves_storage, last.commits) == (
        2 * sum(s % 2 == 0 for s in steps),
        2 * fifths,
        fifths,
    )
    assert last.loads_memory + last.loads_storage == 2


def _families(text: str) -> dict:
    """name → {labels without run and node: value}, as prometheus_client parses the text."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("run", "node")))
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


def test_the_metrics_file_is_whole_at_every_read_and_ends_with_the_runs_final_values(launcher, tmp_path):
    metrics = tmp_path / "textfile" / "ftlaunch.prom"
    metrics.parent.mkdir()
    launch = launcher.start(
        "--nproc", "2", "--metrics-file", str(metrics),
        str(ACTOR), "--fail", "sigkill", "--fail-attempts", "0", "--run-for", "6",
    )  # fmt: skip
    reads = 0
    while launch.proc.poll() is None:  # node_exporter reads it at any moment: never half of it
        if metrics.exists():
            families = _families(metrics.read_text())
            assert "ftlaunch_attempts_total" in families and "ftlaunch_nodes" in families
            reads += 1
        time.sleep(0.05)
    assert launch.wait() == 0, launch.stderr
    assert reads > 0
    final = _families(metrics.read_text())
    assert final["ftlaunch_attempts_total"] == {(): 2.0}
    assert final["ftlaunch_failures_total"][(("kind", "crash"),)] == 1.0
    assert final["ftlaunch_restarts_total"] == {(): 1.0}
    assert final["ftlaunch_group_running"] == {(): 0.0}
    # The actor commits nothing ftlaunch can see and one attempt failed: what it kept is unknown.
    assert math.isnan(final["ftlaunch_goodput_ratio"][()])
    assert "goodput unknown" in launch.stderr
    assert [p.name for p in metrics.parent.iterdir()] == ["ftlaunch.prom"]  # no temporary left


def test_a_run_that_took_no_step_has_no_goodput_and_no_pace_wherever_they_are_said(launcher, tmp_path):
    """Issue 48: `--no-python /bin/echo` said 'goodput 100%' (summary, metrics file, picture) and a
    pace of 0.0 once done, though no step was ever taken: what is not known is NaN, never a number."""
    metrics = tmp_path / "ftlaunch.prom"
    command = ["--run-name", "echo", "--metrics-file", str(metrics), "--no-python", "/bin/echo", "hi"]
    launch = launcher.run(*command)
    assert launch.proc.returncode == 0, launch.stderr
    final = _families(metrics.read_text())
    assert math.isnan(final["ftlaunch_goodput_ratio"][()])
    assert math.isnan(final["ftlaunch_steps_per_second"][()])
    assert "goodput unknown" in launch.stderr and "goodput 1" not in launch.stderr
    figure = draw_run("echo", node_events(RunDir(launch.run_url()).read_events(), None))
    assert figure.axes[0].get_title() == "echo: goodput unknown"
    assert launch.survivors() == []


def test_a_metrics_file_that_cannot_be_written_any_more_is_said_once_and_the_run_goes_on(launcher, tmp_path):
    folder = tmp_path / "textfile"
    folder.mkdir()
    launch = launcher.start(
        "--nproc", "2", "--metrics-file", str(folder / "m.prom"), str(ACTOR), "--run-for", "12",
    )  # fmt: skip
    launch.wait_for_event(Transition, lambda e: e.new.value == "RUNNING", timeout=60)
    shutil.rmtree(folder)  # the disk is gone from under it
    assert launch.wait() == 0, launch.stderr
    assert launch.stderr.count("cannot write the metrics to") == 1, launch.stderr


def test_a_busy_metrics_port_is_a_usage_error_before_any_worker_starts(launcher, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch = launcher.run("--metrics-port", str(port), str(ACTOR), "--run-for", "0")
    assert launch.proc.returncode == 2
    assert f"--metrics-port: cannot listen on 127.0.0.1:{port}" in launch.stderr
    assert "starting" not in launch.stderr and not list(tmp_path.rglob("run.json"))


def test_a_metrics_file_in_a_missing_folder_is_a_usage_error_before_any_worker_starts(launcher, tmp_path):
    nowhere = tmp_path / "nowhere" / "m.prom"
    launch = launcher.run("--metrics-file", str(nowhere), str(ACTOR), "--run-for", "0")
    assert launch.proc.returncode == 2, launch.stderr
    assert "--metrics-file: cannot write" in launch.stderr and "starting" not in launch.stderr


def test_a_refused_second_launch_leaves_the_live_runs_metrics_file_alone(launcher, tmp_path):
    """A second ftlaunch on a held run is refused (exit 2); it must not write the live run's
    --metrics-file (all counters 0: a counter reset for Prometheus) on its way in or out."""
    metrics = tmp_path / "m.prom"
    ready = tmp_path / "ready"
    args = ("--run-name", "held", "--metrics-file", str(metrics), str(ACTOR), "--run-for", "60",
            "--ready-dir", str(ready))  # fmt: skip
    live = launcher.start(*args)
    wait_for_files(ready, "rank_0.attempt_0.pid", 1, timeout=90)
    deadline = time.monotonic() + 30  # the live supervisor's first write
    while not (metrics.exists() and _families(metrics.read_text())["ftlaunch_attempts_total"] == {(): 1.0}):
        assert time.monotonic() < deadline, "the live run never wrote its metrics file"
        time.sleep(0.05)
    refused = launcher.run(*args, timeout=60)
    assert refused.proc.returncode == 2 and "is held by another ftlaunch" in refused.stderr, refused.stderr
    assert _families(metrics.read_text())["ftlaunch_attempts_total"] == {(): 1.0}
    live.proc.send_signal(signal.SIGTERM)
    assert live.wait() == 143, live.stderr


def test_a_stuck_scraper_holds_up_neither_the_run_nor_other_scrapes(launcher, tmp_path):
    """A scraper that connects and never finishes its request: the server answers others on
    threads of their own, and the supervisor's loop never waits for the server."""
    port = _free_port()
    launch = launcher.start(
        "--nproc", "2", "--metrics-port", str(port),
        str(ACTOR), "--fail", "sigkill", "--fail-attempts", "0", "--run-for", "3",
    )  # fmt: skip
    launch.read_console_until(lambda line: "metrics on" in line, stream="stderr", timeout=60)
    stuck = socket.create_connection(("127.0.0.1", port))
    try:
        stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        launch.wait_for_event(Transition, lambda e: e.attempt == 1 and e.new.value == "RUNNING", timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            families = _families(answer.read().decode())
        assert families["ftlaunch_failures_total"][(("kind", "crash"),)] == 1.0
        assert launch.wait() == 0, launch.stderr
    finally:
        stuck.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_metrics_on_ipv6_are_served_and_named_by_a_url_that_works(launcher, tmp_path):
    """--metrics-addr ::1: the console's URL brackets the address (it said http://::1:PORT/,
    which no client parses) and answers."""
    launch = launcher.start(
        "--metrics-port", "0", "--metrics-addr", "::1", str(ACTOR), "--run-for", "60"
    )  # fmt: skip
    line = launch.read_console_until(lambda line: "metrics on" in line, stream="stderr", timeout=60)
    url = re.search(r"metrics on (\S+)", line).group(1)
    assert url.startswith("http://[::1]:") and url.endswith("/metrics"), line
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert "ftlaunch_attempts_total" in answer.read().decode()
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.wait() == 143, launch.stderr
    assert launch.survivors() == []
