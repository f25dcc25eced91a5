"""Stopping the whole tree: signals forwarded, grandchildren included, nothing left after
the supervisor itself is SIGKILLed."""

import io
import os
import re
import signal
import time

import psutil
import pytest
from helpers import ACTOR, memory_folders, wait_for_files

from launcher.agent.parts import worker_plan
from launcher.core.config import EntryKind, LaunchConfig
from launcher.core.events import GroupsGuarded, GuardRestarted, Transition
from launcher.orphan_guard import GUARD_MODULE
from launcher.process.logs import LogPump
from launcher.process.orphan_guard import OrphanGuard
from launcher.process.plan import plan_workers
from launcher.process.workers import PopenSpawner, WorkerGroup


def _start_sleepers(launcher, tmp_path, options=(), actor_args=(), nproc=2):
    """ftlaunch with ``nproc`` ranks that sleep; returns once every rank has announced its pid."""
    ready = tmp_path / "ready"
    launch = launcher.start(
        "--nproc",
        str(nproc),
        *options,
        str(ACTOR),
        "--others",
        "sleep",
        "--ready-dir",
        str(ready),
        *actor_args,
    )
    pids = [int(p.read_text()) for p in wait_for_files(ready, "rank_*.attempt_0.pid", nproc)]
    return launch, pids


@pytest.mark.parametrize("grandchild", ["group", "session"])
def test_supervisor_sigkill_leaves_no_worker_nor_grandchild(launcher, tmp_path, grandchild):
    """A grandchild in its worker's group, or in a session of its own (setsid: no killpg of the
    worker's group reaches it, and it outlives its parent re-parented to init)."""
    options = ["--grace-period", "30"]
    launch, pids = _start_sleepers(launcher, tmp_path, options, ["--grandchild", grandchild], 3)
    # Actor writes its ready file after starting its grandchild, so all of them exist now.
    assert len(launch.survivors()) >= 1 + 1 + 3 * 2  # supervisor, orphan guard, workers, sleeps
    if grandchild == "session":  # the supervisor has told the guard of the three new groups
        _wait_for(lambda: sum(len(e.pgids) for e in launch.events(GroupsGuarded)) >= 3, 30)

    os.kill(launch.proc.pid, signal.SIGKILL)
    launch.wait()

    assert launch.survivors_after(timeout=10) == []
    for pid in pids:  # a dying process may still be tearing its memory down: a moment, bounded
        try:
            _wait_dead(psutil.Process(pid), timeout=10)
        except psutil.NoSuchProcess:
            pass


def _wait_for(ready, timeout):
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.05)


def test_workers_die_with_the_supervisor_even_without_the_orphan_guard(launcher, tmp_path):
    # PR_SET_PDEATHSIG alone: the supervisor is stopped (it cannot replace its guard), the guard is
    # killed, then the supervisor: only the kernel can stop the workers now.
    launch, pids = _start_sleepers(launcher, tmp_path, nproc=2)
    guard = _guard_of(launch)
    os.kill(launch.proc.pid, signal.SIGSTOP)
    guard.kill()
    _wait_dead(guard)

    os.kill(launch.proc.pid, signal.SIGKILL)
    launch.wait()

    assert launch.survivors_after(timeout=10) == []
    # Nothing was left to remove the memory tier's folder: the next supervisor on the node does
    # (under a parallel run another test's may have done it already).
    later = launcher.run("--nproc", "1", str(ACTOR), "--run-for", "0")
    assert later.proc.returncode == 0, later.stderr
    assert memory_folders(launch.proc.pid) == []


def test_a_dead_orphan_guard_is_replaced_at_once(launcher, tmp_path):
    """kill -9 of the guard, then of ftlaunch: the workers' own children (in their process groups)
    must not be left under PID 1."""
    launch, pids = _start_sleepers(launcher, tmp_path, ["--grace-period", "30"], ["--grandchild", "group"], 2)
    guard = _guard_of(launch)
    guard.kill()
    restarted = launch.wait_for_event(GuardRestarted)
    assert restarted.dead_pid == guard.pid and _guard_of(launch).pid == restarted.new_pid

    os.kill(launch.proc.pid, signal.SIGKILL)
    launch.wait()

    assert launch.survivors_after(timeout=10) == []  # the new guard took the grandchildren down
    assert "the orphan guard (pid" in launch.stderr


def _guard_of(launch) -> psutil.Process:
    children = psutil.Process(launch.proc.pid).children()
    return next(p for p in children if GUARD_MODULE in p.cmdline())


def _wait_dead(proc: psutil.Process, timeout: float = 5.0) -> None:
    """Dead, or a zombie its parent has not reaped yet (not our child: psutil.wait can't tell)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {proc.pid} still alive after {timeout}s")


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
    ids=["INT", "TERM", "HUP"],
)
def test_signal_goes_to_workers_and_sets_the_exit_code(launcher, tmp_path, sig, code):
    launch, _ = _start_sleepers(launcher, tmp_path, actor_args=["--trap", "report"])

    os.kill(launch.proc.pid, sig)

    assert launch.wait() == code
    name = signal.Signals(sig).name
    for rank in range(2):  # once: torchrun delivers it once, and a handler that saves must not nest
        assert launch.stdout.count(f"[{rank}] rank {rank} got {name}") == 1, launch.stdout
    assert f"interrupted by {name}" in launch.stderr
    assert launch.survivors() == []


def test_under_nohup_a_hangup_is_ignored(launcher, tmp_path):
    """``nohup ftlaunch ...``: SIGHUP arrives ignored, and stays so for ftlaunch and its workers."""
    ready = tmp_path / "ready"
    launch = launcher.start(
        "--nproc", "2", str(ACTOR), "--run-for", "2", "--ready-dir", str(ready), ignore_sighup=True,
    )  # fmt: skip
    pids = [int(p.read_text()) for p in wait_for_files(ready, "rank_*.attempt_0.pid", 2)]
    os.kill(launch.proc.pid, signal.SIGHUP)
    for pid in pids:
        os.kill(pid, signal.SIGHUP)
    assert launch.wait() == 0, launch.stderr
    assert "interrupted" not in launch.stderr
    assert launch.survivors() == []


@pytest.mark.parametrize("option", [[], ["--preempt-signal", "USR2"]], ids=["USR1", "USR2"])
def test_the_preemption_notice_to_every_process_is_one_sigterm(launcher, tmp_path, option):
    """What `scancel --signal=USR1 --full` does, and a batch script forwarding it once more: every
    process of the step gets the notice. The workers ignore it, the orphan guard too, and the
    supervisor takes the two copies as one preemption: SIGTERM to the workers, exit 143."""
    notice = signal.SIGUSR2 if option else signal.SIGUSR1
    launch, pids = _start_sleepers(launcher, tmp_path, option, ["--trap", "report"])
    guard = _guard_of(launch)
    for pid in pids:
        os.kill(pid, notice)
    os.kill(guard.pid, notice)
    other = signal.SIGUSR1 if option else signal.SIGUSR2
    os.kill(launch.proc.pid, other)  # not the notice: ignored, not fatal
    os.kill(launch.proc.pid, notice)
    os.kill(launch.proc.pid, notice)

    assert launch.wait() == 143
    assert "[0] rank 0 got SIGTERM" in launch.stdout and "[1] rank 1 got SIGTERM" in launch.stdout
    # Taken as SIGTERM, but called by the name it was sent with (it said "SIGTERM", which the
    # user never sent).
    assert f"interrupted by {notice.name} (the preemption notice)" in launch.stderr
    stopped = launch.events(Transition)[-1]
    assert stopped.new == "STOPPED" and stopped.killed is False  # not cut short
    assert launch.events(GuardRestarted) == []
    assert launch.survivors() == []


def test_workers_that_ignore_signals_are_killed_after_the_grace_period(launcher, tmp_path):
    launch, _ = _start_sleepers(launcher, tmp_path, ["--grace-period", "1"], ["--trap", "ignore"])

    os.kill(launch.proc.pid, signal.SIGTERM)

    assert launch.wait() == 143
    stopped = launch.events(Transition)[-1]
    assert stopped.new == "STOPPED" and stopped.killed is True
    assert 1.0 <= stopped.seconds < 10
    assert launch.survivors() == []


def test_second_ctrl_c_stops_at_once(launcher, tmp_path):
    launch, _ = _start_sleepers(launcher, tmp_path, ["--grace-period", "300"], ["--trap", "ignore"])

    os.kill(launch.proc.pid, signal.SIGINT)
    launch.wait_for_event(Transition, lambda e: e.new == "STOPPING")  # the first one is being acted on
    os.kill(launch.proc.pid, signal.SIGINT)

    assert launch.wait(timeout=30) == 130  # not 300 s later
    stopped = launch.events(Transition)[-1]
    assert stopped.killed is True and stopped.seconds < 30
    assert launch.survivors() == []


def test_grandchildren_in_and_out_of_the_worker_group_are_stopped(launcher, tmp_path):
    # One rank's child stays in its process group; a child that called setsid() has left it,
    # and is still found (the supervisor is a subreaper) and stopped.
    for mode in ("group", "session"):
        options = ["--nproc", "2", "--max-failures", "1"]
        behaviour = ["--grandchild", mode, "--fail", "exit", "--fail-attempts", "all", "--fail-after", "0.5"]
        launch = launcher.run(*options, str(ACTOR), *behaviour, "--others", "sleep")
        assert launch.proc.returncode == 1, launch.stderr
        assert launch.stdout.count("grandchild") == 4  # 2 ranks x 2 attempts started one
        assert launch.survivors() == []


def test_a_stopped_worker_is_still_stopped_and_reaped(launcher, tmp_path):
    launch, pids = _start_sleepers(launcher, tmp_path, ["--grace-period", "2"])
    os.kill(pids[0], signal.SIGSTOP)
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 143
    assert launch.survivors() == []


def test_ctrl_c_at_any_moment_of_a_launch_exits_130_without_a_traceback(launcher, tmp_path):
    """Signals at odd moments once the interpreter is up (what CPython does while it imports ``site``
    is not ftlaunch's): while modules load, torch included, during the checks before start, while
    workers start, while they run. Each moment is sampled on purpose, from evidence that Python runs."""
    for i, moment in enumerate((0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2, 2.0)):
        up = tmp_path / f"up_{i}"
        launch = launcher.start(
            "--nproc",
            "2",
            str(ACTOR),
            "--others",
            "sleep",
            "--trap",
            "report",
            log_dir=tmp_path / f"l{i}",
            up_file=up,
        )
        wait_for_files(tmp_path, up.name, 1)
        time.sleep(moment)
        launch.proc.send_signal(signal.SIGINT)
        assert launch.wait(timeout=60) == 130, (moment, launch.stderr)
        own = [line for line in launch.stderr.splitlines() if not re.match(r"\[\d+\] ", line)]  # not workers'
        assert not any("Traceback" in line or "Abort" in line for line in own), (moment, launch.stderr)
        assert launch.survivors() == []


def test_a_signal_while_many_ranks_start_stops_the_rest_from_starting(launcher, tmp_path):
    launch = launcher.start("--nproc", "1000", "--grace-period", "2", "--no-python", "sleep", "1000")
    wait_for_files(launch.log_dir / "attempt_0", "rank_0.log", 1)  # starting has begun
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.wait(timeout=120) == 143, launch.stderr[-2000:]
    started = len(list((launch.log_dir / "attempt_0").glob("rank_*.log")))
    assert started < 1000  # a thousand starts take seconds: it stopped starting them at the signal
    assert launch.survivors_after(timeout=10) == []


def test_the_start_loop_asks_before_each_rank(tmp_path):
    """The mechanism, deterministically: the group starts ranks only while it is told to go on."""
    config = LaunchConfig.of(
        entrypoint="sleep", script_args=("1000",), entry_kind=EntryKind.EXECUTABLE, nproc=5, log_dir=tmp_path
    )
    specs = plan_workers(worker_plan(config), attempt=0, master_port=1)
    asked = []
    with OrphanGuard() as guard:
        pump = LogPump(io.BytesIO(), io.BytesIO())
        group = WorkerGroup(specs, PopenSpawner(), pump, guard, lambda rank: False)
        group.spawn(go_on=lambda: asked.append(1) or len(asked) <= 2)
        started = list(group.pids)
        group.stop(signal.SIGKILL, 0.0, abort=lambda: True)
        pump.close()
    assert len(asked) == 3 and len(started) == 2
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in started)


def test_stopping_never_signals_a_group_that_is_no_longer_ours():
    """A listed group whose processes are all gone frees its number, and the kernel may give it to
    a stranger's new group: after a success every worker is reaped before the sweep of leftover
    grandchildren, which signalled each worker's group id. Here the stranger is a `sleep` outside
    our process tree, in a group whose id we pass as a leader: it must not be signalled."""
    import subprocess

    from launcher.process.tree import stop_tree

    started = subprocess.run(
        ["setsid", "sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    stranger = psutil.Process(int(started.stdout))
    try:
        group = os.getpgid(stranger.pid)
        assert stranger.pid not in {p.pid for p in psutil.Process().children(recursive=True)}  # not ours
        report = stop_tree([group], signal.SIGTERM, 0.2, abort=lambda: False)
        assert stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE
        assert report.survivors == []
    finally:
        stranger.kill()
        _wait_dead(stranger)  # its parent (init) reaps it


_THREAD_FORKS = """
import subprocess, sys, threading, time
def spawn():
    child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    open(sys.argv[1] + ".tmp", "w").write(str(child.pid))
    __import__("os").rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(1000)
threading.Thread(target=spawn, daemon=True).start()
time.sleep(1000)
"""


def test_the_descendant_walk_finds_children_of_every_thread(tmp_path):
    """tree.descendants reads each thread's children file (a child is listed under the thread
    that forked it): a child started from a thread that still runs, one whose thread has exited
    (re-parented to another thread of the process), and a grandchild in a session of its own
    that a thread of its parent started."""
    import subprocess
    import sys
    import threading

    from launcher.process.tree import descendants

    started: dict = {}

    def spawn(name: str) -> None:
        started[name] = subprocess.Popen(["sleep", "1000"], start_new_session=True)

    spawn_and_exit = threading.Thread(target=spawn, args=("thread gone",))
    spawn_and_exit.start()
    spawn_and_exit.join()
    done = threading.Event()
    alive = threading.Thread(target=lambda: (spawn("thread alive"), done.wait(60)), daemon=True)
    alive.start()
    grandchild_file = tmp_path / "grandchild"
    parent = subprocess.Popen([sys.executable, "-c", _THREAD_FORKS, str(grandchild_file)])
    grandchild = None
    try:
        (found,) = wait_for_files(tmp_path, grandchild_file.name, 1)
        grandchild = int(found.read_text())
        _wait_for(lambda: "thread alive" in started, 10)
        expected = {started["thread gone"].pid, started["thread alive"].pid, parent.pid, grandchild}
        assert expected <= set(descendants()), (expected, descendants())
        assert parent.pid not in descendants(exclude={parent.pid})
    finally:
        done.set()
        for proc in [*started.values(), parent]:
            proc.kill()
            proc.wait()
        if grandchild is not None:  # re-parented out of our tree once its parent is gone
            os.kill(grandchild, signal.SIGKILL)


def test_the_periodic_look_reads_only_our_main_thread_s_children():
    """The group look's walk (every half second) skips children of our threads other than the
    main one, which are never workers (the supervisor forks from its main thread only, and
    orphans are re-parented to it); a stop's walk still reads every thread."""
    import subprocess
    import threading

    from launcher.process.tree import descendants

    started: dict = {}
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (started.setdefault("child", subprocess.Popen(["sleep", "1000"])), done.wait(60)),
        daemon=True,
    )
    thread.start()
    try:
        _wait_for(lambda: "child" in started, 10)
        child = started["child"].pid
        assert child in descendants()
        assert child not in descendants(our_main_thread_only=True)
    finally:
        done.set()
        thread.join()
        if "child" in started:
            started["child"].kill()
            started["child"].wait()
