"""Warm spares on CPU (``--warm-spare on``): a parked process per local rank is made, handed its rank
on a restart (the restarted worker's pid is the spare's), made again, and never left behind
however the run ends. Their CUDA side is tests/gpu/test_warm_spare.py's. With spares off, a failed
group's stop forks the next group's processes ahead, parked the same way (the last tests)."""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict

import psutil
import pytest
from helpers import frozen_at, wait_for_files
from test_fork_server import _zygote_of

from launcher.forked.protocol import SPARE_TITLE
from launcher.process.plan import WorkerSpec
from launcher.process.warm_spares import Spare, SpareFailed, SpareState, WarmSpares

# Rank r of attempt a writes its pid to <dir>/rank_<r>.attempt_<a>.pid, then waits (bounded) for
# <dir>/go.<a>, and exits with the code that file holds.
WAITER = """
import os, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
mark = folder / f"rank_{rank}.attempt_{attempt}.pid"
(folder / f"{mark.name}.tmp").write_text(str(os.getpid()))
(folder / f"{mark.name}.tmp").rename(mark)  # whole, or not there at all: the test reads it at once
go = folder / f"go.{attempt}"
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(int(go.read_text()) if go.exists() else 3)
"""


def _start(launcher, tmp_path: Path, *options: str):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    folder = tmp_path / "ranks"
    folder.mkdir()
    launch = launcher.start("--nproc", "2", "--warm-spare", "on", *options, str(script), str(folder))
    return launch, folder


def _go(folder: Path, attempt: int, code: int) -> None:
    (folder / f"go.{attempt}.tmp").write_text(str(code))
    (folder / f"go.{attempt}.tmp").rename(folder / f"go.{attempt}")


def _worker_pids(folder: Path, attempt: int) -> Dict[int, int]:
    found = wait_for_files(folder, f"rank_*.attempt_{attempt}.pid", 2, timeout=60)
    return {int(f.name.split(".")[0].split("_")[1]): int(f.read_text()) for f in found}


def _spares(launch, other_than=(), timeout: float = 60.0) -> Dict[int, int]:
    """Local rank → pid of the supervisor's parked spares, once there is a warm one (``ftlaunch-spare
    R ready`` in ps: a restart takes only those) for each local rank that is none of ``other_than``;
    bounded."""
    supervisor = psutil.Process(launch.proc.pid)
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for child in supervisor.children():
            try:
                shown = child.cmdline()
                if (
                    child.status() != psutil.STATUS_ZOMBIE
                    and shown[:1] == [SPARE_TITLE]
                    and shown[2:3] == ["ready"]
                ):
                    found[int(shown[1])] = child.pid
            except (psutil.NoSuchProcess, IndexError):
                continue
        if sorted(found) == [0, 1] and not set(found.values()) & set(other_than):
            return found
        assert time.monotonic() < deadline, f"spares seen: {found} (not new: {other_than})"
        time.sleep(0.02)


def _gone(pids, timeout: float = 10.0) -> bool:
    """None of ``pids`` runs (a zombie has exited; an unknown pid is gone), waiting for it up to
    ``timeout`` s: a killed process takes the kernel a moment to unmap."""
    deadline = time.monotonic() + timeout
    while any(_runs(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _runs(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_spare_is_made_handed_its_rank_on_a_restart_and_made_again(launcher, tmp_path):
    launch, folder = _start(launcher, tmp_path, "--max-failures", "2")
    first = _worker_pids(folder, 0)
    spares = _spares(launch)
    assert not set(spares.values()) & set(first.values())  # parked beside the workers, not them
    for pid in spares.values():
        spare = psutil.Process(pid)
        assert spare.ppid() == launch.proc.pid and os.getsid(pid) == pid  # ours, its own session
    _go(folder, 0, 1)  # the group fails: the restart takes the spares
    assert _worker_pids(folder, 1) == spares
    again = _spares(launch, other_than=spares.values())  # made again for the next restart
    _go(folder, 1, 1)
    assert _worker_pids(folder, 2) == again
    _go(folder, 2, 0)
    assert launch.wait(60) == 0, launch.stderr
    assert "warm spare: 2 parked worker(s), one per local rank, forked ahead (no CUDA)" in launch.stderr
    assert launch.stderr.count("warm spare:") == 1 and "warm spare off" not in launch.stderr
    assert "fork server off" not in launch.stderr
    assert launch.survivors() == []


@pytest.mark.parametrize("end", ["success", "failure", "SIGTERM", "kill -9"])
def test_no_spare_outlives_the_run_however_it_ends(launcher, tmp_path, end):
    launch, folder = _start(launcher, tmp_path, "--max-failures", "0")
    _worker_pids(folder, 0)
    spares = _spares(launch).values()
    if end in ("success", "failure"):
        _go(folder, 0, 0 if end == "success" else 1)
        assert launch.wait(60) == (0 if end == "success" else 1), launch.stderr
    elif end == "SIGTERM":
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait(60) == 143, launch.stderr
    else:
        launch.proc.send_signal(signal.SIGKILL)  # PDEATHSIG and the orphan guard take them
        assert launch.wait(60) == -signal.SIGKILL
    assert launch.survivors_after(10) == []
    assert _gone(spares)


def test_spares_serve_after_the_fork_server_died_and_none_is_made_after(launcher, tmp_path):
    """The zygote dies while spares are parked: they need nothing of it, so the next attempt's
    ranks are still the spares. Making them again finds it dead, says so once, parks none, and
    the attempt after starts its ranks as new processes."""
    launch, folder = _start(launcher, tmp_path, "--max-failures", "2")
    _worker_pids(folder, 0)
    spares = _spares(launch)
    zygote = _zygote_of(launch)
    zygote.send_signal(signal.SIGKILL)
    psutil.wait_procs([zygote], timeout=10)
    _go(folder, 0, 1)
    assert _worker_pids(folder, 1) == spares  # one node: rank r is local rank r
    launch.read_console_until(lambda line: "fork server off" in line, stream="stderr")
    _go(folder, 1, 1)
    spawned = _worker_pids(folder, 2)
    assert not set(spawned.values()) & set(spares.values())
    children = [p.cmdline()[:1] for p in psutil.Process(launch.proc.pid).children()]
    assert [SPARE_TITLE] not in children
    _go(folder, 2, 0)
    assert launch.wait(60) == 0, launch.stderr
    assert launch.stderr.count("fork server off") == 1
    assert launch.survivors() == []


def test_a_spare_that_died_while_parked_turns_spares_off_and_the_rank_starts_anyway(launcher, tmp_path):
    launch, folder = _start(launcher, tmp_path, "--max-failures", "1")
    _worker_pids(folder, 0)
    spares = _spares(launch)
    os.kill(spares[1], signal.SIGKILL)
    _go(folder, 0, 1)
    restarted = _worker_pids(folder, 1)
    assert restarted[0] == spares[0] and restarted[1] != spares[1]  # forked from the zygote instead
    _go(folder, 1, 0)
    assert launch.wait(60) == 0, launch.stderr
    said = "warm spare off: local rank 1's spare died (exit -9); ranks start as forks of the fork server"
    assert said in launch.stderr, launch.stderr
    assert "fork server off" not in launch.stderr
    assert launch.survivors() == []


def test_a_rank_too_large_to_hand_to_a_spare_is_said_as_such(tmp_path):
    """On a node without a store host to fork first (a follower), a rank's request too large for
    one message is the first thing to meet the limit: said as that, not as a dead spare."""
    child = subprocess.Popen(["sleep", "60"])  # stands for the parked spare: a live child of ours
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        spare = Spare(0, child.pid, ours, cuda=False)
        spare.state = SpareState.READY
        env = {"LOCAL_RANK": "0", **{f"BIG_{i}": "x" * 60_000 for i in range(5)}}
        spec = WorkerSpec(0, 0, ("python", "train.py"), env, tmp_path / "log", tmp_path / "err")
        with pytest.raises(
            SpareFailed, match=r"environment \(29\d KiB\) are more than one message to a spare"
        ):
            spare.take(spec, 1, 2, lambda: True)
    finally:
        theirs.close()
        spare.discard()
    assert child.poll() is not None  # let go: killed and reaped


class _Guard:
    """Stands for the run's orphan guard, which WarmSpares only tells what to watch."""

    def watch(self, pid: int) -> None:
        pass

    def forget(self, pid: int) -> None:
        pass


def test_a_restart_never_waits_for_a_spare_still_warming_up_and_takes_it_once_warm(tmp_path):
    """A spare that has not said it is ready (its CUDA context takes seconds) is passed over (the
    rank is forked instead) and kept for the next start, which takes it once it has said so."""
    child = subprocess.Popen(["sleep", "60"])  # stands for the spare: a live child of ours
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    said = []
    spares = WarmSpares(1, cuda=True, say=said.append)
    spec = WorkerSpec(0, 0, ("python", "train.py"), {"LOCAL_RANK": "0"}, tmp_path / "log", tmp_path / "err")
    try:
        assert not spares.make_one(lambda rank, cuda: (child.pid, ours), _Guard())
        assert spares.take(spec, 1, 2) is None  # still warming: not waited for
        assert spares.pids == (child.pid,) and said == []  # kept, not let go
        theirs.send(json.dumps({"ready": {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}}).encode())

        def answer() -> None:
            request, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 2)
            for fd in fds:
                os.close(fd)
            assert json.loads(request)["env"]["LOCAL_RANK"] == "0"
            theirs.send(json.dumps({"pid": child.pid}).encode())

        helper = threading.Thread(target=answer)
        helper.start()
        out_r, out_w = os.pipe()
        try:
            worker = spares.take(spec, out_w, out_w)
        finally:
            os.close(out_r)
            os.close(out_w)
        helper.join(10)
        assert worker is not None and worker.pid == child.pid and spares.pids == ()
    finally:
        theirs.close()
        spares.close()
        child.kill()
        child.wait(10)
    assert child.poll() is not None


def test_a_process_forked_ahead_without_cuda_is_waited_for_not_forked_anew(tmp_path):
    """Without CUDA a parked process is ready a moment after its fork: a restart that comes first
    waits for it (found from outside: a many-node leader met the others before its process forked
    ahead said ready, forked its rank anew and kept the unused one parked through the attempt)."""
    child = subprocess.Popen(["sleep", "60"])  # stands for the parked process
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spares = WarmSpares(1, cuda=False, say=lambda line: None, on=False)
    spec = WorkerSpec(0, 0, ("python", "train.py"), {"LOCAL_RANK": "0"}, tmp_path / "log", tmp_path / "err")
    asked = []

    def go_on() -> bool:  # called once the restart waits for it: only then does it say ready
        if not asked:
            theirs.send(json.dumps({"ready": {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}}).encode())
        asked.append(1)
        return True

    def answer() -> None:
        request, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 2)
        for fd in fds:
            os.close(fd)
        theirs.send(json.dumps({"pid": child.pid}).encode())

    try:
        spares.add_parked(0, child.pid, ours, _Guard())
        helper = threading.Thread(target=answer)
        helper.start()
        worker = spares.take(spec, 1, 2, go_on)
        helper.join(10)
        assert asked and worker is not None and worker.pid == child.pid and spares.pids == ()
    finally:
        theirs.close()
        spares.close()
        child.kill()
        child.wait(10)


@pytest.mark.parametrize("frozen", ["before its ready word", "at its hand-over"])
def test_a_frozen_parked_process_costs_a_restart_its_deadline_then_the_rank_starts_anyway(tmp_path, frozen):
    """A parked process without CUDA answers in milliseconds: frozen (SIGSTOP), it is given up on
    after a few seconds (it was 10), killed, and said once; the rank is then started the usual
    way."""
    child = subprocess.Popen(["sleep", "60"])  # stands for the parked process
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    said = []
    spares = WarmSpares(1, cuda=False, say=said.append)
    spec = WorkerSpec(0, 0, ("python", "train.py"), {"LOCAL_RANK": "0"}, tmp_path / "log", tmp_path / "err")
    try:
        spares.make_one(lambda rank, cuda: (child.pid, ours), _Guard())
        if frozen == "at its hand-over":
            theirs.send(json.dumps({"ready": {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}}).encode())
        child.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        assert spares.take(spec, 1, 2) is None
        took = time.monotonic() - started
        assert 4.0 < took < 7.0, f"{took:.1f} s"
        assert child.poll() is not None and spares.pids == ()  # killed and reaped
        (line,) = said
        assert line.startswith("warm spare off: local rank 0's spare gave no answer"), line
    finally:
        theirs.close()
        spares.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_a_signal_during_a_hand_over_is_answered_and_the_spare_let_go(tmp_path):
    """The spare has the rank's request but has not answered (it is registering a large slot, or it
    is stopped): a signal ends the wait at once, and the spare, which may be that rank's worker by
    now, is killed, never left to run the rank beside the one started instead."""
    child = subprocess.Popen(["sleep", "60"])  # stands for a spare that never answers
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spares = WarmSpares(1, cuda=False, say=lambda line: None)
    spec = WorkerSpec(0, 0, ("python", "train.py"), {"LOCAL_RANK": "0"}, tmp_path / "log", tmp_path / "err")
    try:
        spares.make_one(lambda rank, cuda: (child.pid, ours), _Guard())
        theirs.send(json.dumps({"ready": {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}}).encode())
        asked = []

        def go_on() -> bool:  # the signal comes once the request is on its way
            asked.append(1)
            return len(asked) < 2

        out_r, out_w = os.pipe()
        try:
            assert spares.take(spec, out_w, out_w, go_on) is None
        finally:
            os.close(out_r)
            os.close(out_w)
        request, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 2)  # it was handed the rank
        for fd in fds:
            os.close(fd)
        assert json.loads(request)["env"]["LOCAL_RANK"] == "0"
        assert spares.pids == () and child.poll() is not None  # killed and reaped
    finally:
        theirs.close()
        spares.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


# Rank r of attempt a writes its pid to <dir>/rank_<r>.attempt_<a>.pid. Rank 1 of attempt 0 then
# waits (bounded) for <dir>/fail and exits 1; every other rank waits for <dir>/go.<a> and exits
# with the code it holds. A SIGTERM is answered only once <dir>/release exists, so the failed
# group's stop lasts until the test says.
LINGERER = """
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]

def wait_for(path):
    deadline = time.monotonic() + 120
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()

def term(*_):
    sys.exit(0 if wait_for(folder / "release") else 3)

signal.signal(signal.SIGTERM, term)
mark = folder / f"rank_{rank}.attempt_{attempt}.pid"
(folder / f"{mark.name}.tmp").write_text(str(os.getpid()))
(folder / f"{mark.name}.tmp").rename(mark)
if (rank, attempt) == ("1", "0"):
    sys.exit(1 if wait_for(folder / "fail") else 3)
go = folder / f"go.{attempt}"
sys.exit(int(go.read_text()) if wait_for(go) else 3)
"""


@pytest.mark.parametrize("then", ["restart", "no restart"])
def test_a_failed_groups_stop_forks_the_next_ranks_ahead_only_where_the_policy_may_restart(
    launcher, tmp_path, then
):
    """While rank 0 of the failed group still answers its SIGTERM, a parked process per local rank
    is already there (spares off: these are the restart's own, without CUDA); the restart's ranks
    are those processes. With --max-failures 0 nothing is asked for: the supervisor, frozen just
    after the stop's first signal (a failpoint), holds no socket to a process made ahead. (It
    asked for them anyway, and the run's end killed them.)"""
    script = tmp_path / "lingerer.py"
    script.write_text(LINGERER)
    folder = tmp_path / "ranks"
    folder.mkdir()
    budget = "1" if then == "restart" else "0"
    launch = launcher.start(
        "--nproc", "2", "--max-failures", budget, "--grace-period", "120", str(script), str(folder),
        env={"FTLAUNCH_FAILPOINT": "stop-signalled"},
    )  # fmt: skip
    first = _worker_pids(folder, 0)
    assert not _parked(launch)  # none while the group runs: spares are off
    supervisor = psutil.Process(launch.proc.pid)
    held = len(_local_sockets(supervisor))
    (folder / "fail").write_text("")
    frozen_at(launch, "stop-signalled")
    asked = len(_local_sockets(supervisor)) - held  # our end of each parked process's socket
    supervisor.resume()
    if then == "restart":
        assert asked == 2
        parked = _spares(launch)  # rank 0 is still stopping: it waits for release
        assert _runs(first[0]) and not set(parked.values()) & set(first.values())
        (folder / "release").write_text("")
        assert _worker_pids(folder, 1) == parked
        _go(folder, 1, 0)
        frozen_at(launch, "stop-signalled")  # the succeeded group's sweep stops there too
        supervisor.resume()
        assert launch.wait(60) == 0, launch.stderr
    else:
        assert asked == 0 and not _parked(launch)
        (folder / "release").write_text("")
        assert launch.wait(60) == 1, launch.stderr
    assert "warm spare" not in launch.stderr and "fork server off" not in launch.stderr
    assert launch.survivors() == []


def test_a_frozen_fork_server_never_holds_a_failed_groups_stop_past_its_grace(launcher, tmp_path):
    """The processes are forked ahead without waiting for the fork server: frozen (SIGSTOP), it
    keeps neither the grace period from ending in a SIGKILL nor the run from ending. (The first
    version waited for its answer, up to 10 s, before the grace period even began.)"""
    from launcher.core.events import Transition
    from launcher.core.group_state import GroupState

    script = tmp_path / "lingerer.py"
    script.write_text(LINGERER)
    folder = tmp_path / "ranks"
    folder.mkdir()
    launch = launcher.start(
        "--nproc", "2", "--max-failures", "0", "--grace-period", "1", str(script), str(folder)
    )
    _worker_pids(folder, 0)
    zygote = _zygote_of(launch)
    zygote.suspend()
    try:
        (folder / "fail").write_text("")  # rank 0 answers its SIGTERM never: it is killed at 1 s
        assert launch.wait(60) == 1, launch.stderr
        stopped = launch.wait_for_event(Transition, lambda t: t.new is GroupState.STOPPED)
        # About the grace period and a kill: the old wait for the frozen fork server alone took 10 s.
        assert stopped.killed and stopped.seconds is not None and stopped.seconds < 6, stopped
    finally:
        if zygote.is_running():
            zygote.resume()
    assert launch.survivors_after(10) == []


def test_a_fork_server_frozen_at_a_crash_holds_the_restart_its_deadline_then_ranks_are_spawned(
    launcher, tmp_path
):
    """Frozen (SIGSTOP) when the group fails, the fork server never answers the request for the
    next ranks that the stop sends: the restart waits for it its deadline (a few seconds; it was
    30), says once that it is off, and spawns its ranks as new processes."""
    from launcher.core.events import Transition
    from launcher.core.group_state import GroupState

    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    folder = tmp_path / "ranks"
    folder.mkdir()
    launch = launcher.start("--nproc", "2", "--max-failures", "1", str(script), str(folder))
    first = _worker_pids(folder, 0)
    zygote = _zygote_of(launch)
    zygote.suspend()  # idle until the crash: frozen now is frozen at the crash
    try:
        _go(folder, 0, 1)  # both ranks exit 1
        restarted = _worker_pids(folder, 1)
    finally:
        if zygote.is_running():
            zygote.resume()
    assert not set(restarted.values()) & set(first.values())
    _go(folder, 1, 0)
    assert launch.wait(60) == 0, launch.stderr
    moments = {(t.event.attempt, t.event.new): t.t_mono for t in launch.logged(Transition)}
    held = moments[1, GroupState.RUNNING] - moments[0, GroupState.FAILED]
    assert held < 5.0 + 5.0, f"the restart took {held:.1f} s"  # its deadline, and a spawn of 2 ranks
    assert launch.stderr.count("fork server off: no answer to fork within 5 s") == 1, launch.stderr
    assert launch.survivors() == []


def test_a_fork_server_dead_with_the_request_ahead_unread_is_left_and_the_run_goes_on(launcher, tmp_path):
    """The zygote frozen, then killed while the failed group stops and the request for the next
    ranks lies unread in its socket: reading its answer meets a reset, not an EOF. That is the
    fork server gone, said once; the restart spawns its ranks and the run succeeds. (Found from
    outside: exit 70, ConnectionResetError.)"""
    script = tmp_path / "lingerer.py"
    script.write_text(LINGERER)
    folder = tmp_path / "ranks"
    folder.mkdir()
    options = ("--nproc", "2", "--max-failures", "1", "--grace-period", "120")
    launch = launcher.start(*options, str(script), str(folder))
    first = _worker_pids(folder, 0)
    supervisor = psutil.Process(launch.proc.pid)
    held = len(_sockets(supervisor))
    zygote = _zygote_of(launch)
    zygote.suspend()
    (folder / "fail").write_text("")  # rank 0 then waits for release: the stop goes on
    deadline = time.monotonic() + 60
    while len(_sockets(supervisor)) < held + 2:  # the request is out: our end of each one's socket
        assert time.monotonic() < deadline, "no request for the next ranks was sent"
        time.sleep(0.02)
    zygote.kill()
    (folder / "release").write_text("")
    restarted = _worker_pids(folder, 1)
    assert not set(restarted.values()) & set(first.values())
    _go(folder, 1, 0)
    assert launch.wait(60) == 0, launch.stderr
    assert launch.stderr.count("fork server off: it died") == 1, launch.stderr
    assert "internal error" not in launch.stderr and "Traceback" not in launch.stderr
    assert launch.survivors() == []


def _sockets(process: psutil.Process) -> list:
    """The sockets among ``process``'s open files."""
    found = []
    for fd in os.listdir(f"/proc/{process.pid}/fd"):
        try:
            if os.readlink(f"/proc/{process.pid}/fd/{fd}").startswith("socket:"):
                found.append(fd)
        except OSError:  # closed meanwhile
            continue
    return found


def _local_sockets(process: psutil.Process) -> list:
    """``process``'s Unix sockets (a fork server's, a parked process's), not its TCP connections."""
    return process.net_connections(kind="unix")


def _parked(launch) -> list:
    """The supervisor's children that show themselves as spares (parked, warm or not)."""
    found = []
    for child in psutil.Process(launch.proc.pid).children():
        try:
            if child.cmdline()[:1] == [SPARE_TITLE]:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def test_on_many_nodes_the_next_ranks_are_forked_ahead_at_the_verdict_not_during_the_stop(launcher, tmp_path):
    """Nodes sharing a machine need its CPU to hear of a crash and stop their ranks: a node of many
    forks the next group once the job's verdict says restart (before the nodes meet again), not
    while its own group stops. Node 1's rank fails and node 0's rank lingers in its SIGTERM, so the
    verdict waits: node 1, its group stopped, has asked its (frozen) fork server for nothing; once
    the verdict comes it asks, and the restart takes what it made. (Forked during the stop, 16
    loopback nodes' ranks were all stopped 0.24-0.32 s after a crash, against 0.13-0.15 s.)"""
    from test_many_nodes import Job

    from launcher.core.events import Transition
    from launcher.core.group_state import GroupState

    script = tmp_path / "lingerer.py"
    script.write_text(LINGERER)
    folder = tmp_path / "ranks"
    folder.mkdir()
    job = Job(
        launcher, tmp_path, 2, "--nproc", "1", "--max-failures", "1", "--grace-period", "120",
        str(script), str(folder), node_timeout="15s",
    )  # fmt: skip
    job.start_all()
    first = _worker_pids(folder, 0)
    node1 = job.nodes[1]
    supervisor = psutil.Process(node1.proc.pid)
    held = len(_local_sockets(supervisor))  # its store connections come and go: TCP not counted
    zygote = _zygote_of(node1)
    zygote.suspend()  # a request sent to it stays pending: our end of its socket stays open
    try:
        (folder / "fail").write_text("")  # rank 1 (node 1) exits 1; rank 0 (node 0) lingers
        node1.wait_for_event(Transition, lambda t: t.new is GroupState.STOPPED, timeout=60)
        assert len(_local_sockets(supervisor)) == held, "node 1 forked ahead during its stop"
        assert _runs(first[0])  # the verdict still waits for node 0's group
        (folder / "release").write_text("")
        deadline = time.monotonic() + 60
        while len(_local_sockets(supervisor)) < held + 1:  # asked once the verdict is in
            assert time.monotonic() < deadline, "node 1 never forked its rank ahead"
            time.sleep(0.02)
    finally:
        if zygote.is_running():
            zygote.resume()
    restarted = _worker_pids(folder, 1)
    assert not set(restarted.values()) & set(first.values())
    assert _parked(node1) == []  # the restart took what was forked ahead: none left unused
    _go(folder, 1, 0)
    assert job.wait(120) == {0: 0, 1: 0}, [launch.stderr for launch in job.nodes.values()]
    for launch in job.nodes.values():
        assert "fork server off" not in launch.stderr and "Traceback" not in launch.stderr
    assert job.survivors() == []
