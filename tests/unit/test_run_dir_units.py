"""RunDir's lock and state files on a real directory, without a supervisor."""

import dataclasses
import json
import os
import socket
import time

import pytest
from helpers import dead_pid

from launcher.agent.parts import run_terms
from launcher.core.events import FirstStep
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.owned import pid_space
from launcher.core.records import AttemptEntry, RunState
from launcher.grammar.errors import RunBusy, UsageError
from launcher.runs.directory import LOCK_FILE, LockRecord, LockState, RunDir


def test_the_lock_is_held_renewed_and_released(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    assert run.acquire(lease=30.0) is None  # nobody held it
    with pytest.raises(RunBusy, match=f"pid {os.getpid()}"):
        RunDir(str(tmp_path / "run")).acquire(lease=30.0)  # we are alive: a second holder is refused

    held = run.read_lock()
    assert not run.renew_due(held.renewed_at + 9.0) and run.renew_due(held.renewed_at + 11.0)
    run.renew()
    assert run.read_lock().renewed_at >= held.renewed_at and run.read_lock().token == held.token

    run.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.acquire(lease=30.0)
    other = dataclasses.replace(run.read_lock(), token="someone-else")
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(dataclasses.asdict(other)))
    run.release()
    assert run.read_lock().token == "someone-else"


def test_expired_and_dead_holders_are_taken_over(tmp_path):
    me = LockRecord.me(lease=30.0)
    expired = dataclasses.replace(me, host="elsewhere", renewed_at=me.renewed_at - 31.0)
    assert expired.expired(me.renewed_at) and not expired.provably_dead()
    reused_pid = dataclasses.replace(me, pid_started=me.pid_started - 100.0)  # our pid, another process
    assert reused_pid.provably_dead()
    for previous in (expired, reused_pid):
        folder = tmp_path / previous.host / str(previous.pid_started)
        folder.mkdir(parents=True)
        (folder / LOCK_FILE).write_text(json.dumps(dataclasses.asdict(previous)))
        run = RunDir(str(folder))
        assert run.acquire(lease=30.0) == previous
        run.release()


def test_state_is_written_whole_and_read_back_typed(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    assert run.read_state() is None
    state = RunState("run", str(tmp_path / "run"), RunStatus.RUNNING, 1.0, {"nproc": 2})
    state.attempts.append(AttemptEntry(0, 2.0, "host", 42, outcome=AttemptOutcome.FAILED))
    run.write_state(state)
    assert run.read_state() == state and run.read_state().attempts[0].outcome is AttemptOutcome.FAILED
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json"]  # no temporary left


@pytest.mark.parametrize("text", ["{}", "[]", "", '{"status": "WHO KNOWS"}', "null", '{"status": "RUNNING"}'])
def test_a_damaged_state_file_is_a_usage_error_naming_it(tmp_path, text):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(text)
    with pytest.raises(UsageError, match=r"run/run.json is damaged \(.*\); --fresh starts the run anew"):
        RunDir(str(tmp_path / "run")).read_state()


def test_damaged_event_lines_are_skipped(tmp_path, caplog):
    (tmp_path / "run").mkdir()
    good = '{"event": "first_step", "t_mono": 1.0, "t_wall": 2.0, "attempt": 0}'
    (tmp_path / "run" / "events.jsonl").write_text(f'{good}\ngarbage\n{{"event": "first_st\n{good}')
    events = RunDir(str(tmp_path / "run")).read_events()
    assert [(e.event, e.t_mono) for e in events] == [(FirstStep(0), 1.0), (FirstStep(0), 1.0)]
    assert "skipped 2 line(s) that are not events" in caplog.text


@pytest.mark.parametrize("kind, warned", [("state", True), ("dcp", False), ("replicated", False)])
def test_a_run_at_another_size_warns_only_of_steps_it_cannot_load(tmp_path, kind, warned):
    """Regression (issue 33): a DCP run relaunched at another --nproc was warned that its steps
    would not load, though DCP reshards them. Only per-rank parts saved at the old size warrant it."""
    from launcher.core.config import EntrySection, GroupSection, LaunchConfig, RunSection
    from launcher.core.events import EventLog
    from launcher.runs.checkpoints import CheckpointDir
    from launcher.runs.opening import RunOpening
    from worker_lib.checkpoint.marker import MARKER, CommitMarker, step_dir

    url, ckpt = str(tmp_path / "run"), tmp_path / "ckpt"
    (ckpt / step_dir(20)).mkdir(parents=True)
    (ckpt / step_dir(20) / MARKER).write_bytes(CommitMarker(20, 2, kind, {}).to_bytes())

    def config(nproc: int) -> LaunchConfig:
        group = GroupSection(nproc=nproc, log_dir=tmp_path / "logs", checkpoint_url=str(ckpt))
        return LaunchConfig(EntrySection("train.py"), group=group, run=RunSection(url=url, name="run"))

    before = RunState("run", url, RunStatus.PREEMPTED, 1.0, config(2).to_json())
    RunDir(url).write_state(before)
    said = []
    with EventLog(tmp_path / "events.jsonl") as events:
        checkpoints = CheckpointDir(str(ckpt), world_size=1)
        RunOpening(run_terms(config(1)), RunDir(url), events, said.append, checkpoints.newest).open(None)
    sizes = [line for line in said if "goes on at another size (--nproc 2 then, 1 now)" in line]
    assert len(sizes) == 1, said
    assert sizes[0].startswith("WARNING: ") == warned
    assert ("step(s) 20 were saved by one rank each (per-rank parts)" in sizes[0]) == warned


def test_an_uncommitted_step_newer_than_every_committed_one_is_lost_work():
    from launcher.runs.checkpoints import Uncommitted

    assert Uncommitted([7], newest_committed=5).newest_lost
    assert Uncommitted([3], newest_committed=None).newest_lost
    assert not Uncommitted([3, 4], newest_committed=5).newest_lost  # leftovers of older saves
    assert not Uncommitted([], newest_committed=5).newest_lost


@pytest.mark.parametrize(
    "fields",
    [
        {"lease": float("nan")},
        {"lease": 0.0},
        {"lease": -5.0},
        {"renewed_at": float("inf")},
        {"lease": 10**400},
        {"pid": -5},  # psutil raised ValueError: `status` exited 70
        {"pid": 2**40},
        {"renewed_at": 1e300},  # `status` said it was renewed -1e300 s ago, in 300 digits
        {"pid_started": -1e15},
    ],
)
def test_a_lock_with_numbers_no_ftlaunch_writes_is_damaged(tmp_path, fields):
    """A NaN lease never expires (a launch waiting for it would wait for ever); 10**400 is no float."""
    record = dataclasses.replace(LockRecord.me(lease=30.0), host="elsewhere", **fields)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(dataclasses.asdict(record)))
    with pytest.raises(
        UsageError, match=rf"run/lock.json is damaged \({next(iter(fields))} is .*\); if no ftlaunch"
    ):
        RunDir(str(tmp_path / "run")).read_lock()


def _whole_state(url: str) -> RunState:
    """A run's state with every kind of field run.json holds, as a supervisor writes them."""
    from launcher.core.records import FailureCause, FailureEntry

    state = RunState("run", url, RunStatus.FAILED, 1.0e9, {"nproc": 2}, latest_step=4, updated_at=1.0e9)
    failure = FailureEntry(-1, FailureCause.NODE_LOST, "node 1 lost", 1.0e9 + 5, node=1)
    state.attempts.append(
        AttemptEntry(
            0, 1.0e9, "host", 42, ended_at=1.0e9 + 5, outcome=AttemptOutcome.FAILED, failures=[failure]
        )
    )
    state.attempts[0].nodes = [{"node": 0, "host": "host", "pid": 42}]
    return state


@pytest.mark.parametrize(
    "where, field, value",
    [
        ("attempt", "started_at", 1e300),  # `status` once raised OverflowError in strftime: exit 70
        ("attempt", "ended_at", 1e308),
        ("run", "created_at", 1e308),
        ("attempt", "started_at", -1e18),  # `status` once said "[Errno 75] Value too large"
        ("attempt", "ended_at", float("nan")),
        ("failure", "at", float("inf")),
        ("attempt", "attempt", "zero"),
        ("attempt", "resumed_from_step", 10**40),
        ("run", "latest_step", -1),
        ("failure", "rank", -2),  # -1 is a whole node; nothing is below it
        ("attempt", "beat", 1),
        ("attempt", "supervisor_pid", True),
        ("attempt", "outcome", "WON"),
        ("attempt", "outcome", ["FAILED"]),
        ("attempt", "host", 7),
        ("run", "config", []),
        ("node", "pid", "42"),
        ("run", "takeovers", ["someone"]),
        ("config", "nproc", "x"),  # `status` of a RUNNING run did int() on it: exit 70
        ("config", "checkpoint_url", 5),
        ("config", "script_args", [1]),  # a relaunch compares commands with it
    ],
)
def test_a_state_with_values_no_supervisor_writes_is_damaged_naming_the_field(tmp_path, where, field, value):
    """The one reader of run.json refuses them, so neither `status` nor a launch resuming the run
    meets them later."""
    url = str(tmp_path / "run")
    RunDir(url).write_state(_whole_state(url))
    data = json.loads((tmp_path / "run" / "run.json").read_text())
    attempt = data["attempts"][0]
    target = {
        "run": data,
        "config": data["config"],
        "attempt": attempt,
        "failure": attempt["failures"][0],
        "node": attempt["nodes"][0],
    }
    target[where][field] = value
    (tmp_path / "run" / "run.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match=rf"run/run.json is damaged \({field} is .*\); --fresh starts"):
        RunDir(url).read_state()


def test_a_whole_state_reads_back_as_written(tmp_path):
    """The checks refuse only what no supervisor writes: a whole node's rank -1, None, 0.0."""
    url = str(tmp_path / "run")
    RunDir(url).write_state(_whole_state(url))
    assert RunDir(url).read_state() == _whole_state(url)


def test_a_run_dir_copied_elsewhere_and_resumed_records_where_it_is_now(tmp_path):
    """Issue 48: a copied run dir kept its old URL in run.json (a relaunch of a succeeded one
    named it: tests/test_plot.py); a resumed one records the new URL."""
    from launcher.core.config import EntrySection, GroupSection, LaunchConfig, RunSection
    from launcher.core.events import EventLog
    from launcher.runs.checkpoints import NewestCheckpoint
    from launcher.runs.opening import RunOpening

    url = str(tmp_path / "copy" / "run")
    group = GroupSection(nproc=1, log_dir=tmp_path / "logs", checkpoint_url=str(tmp_path / "ckpt"))
    config = LaunchConfig(EntrySection("train.py"), group=group, run=RunSection(url=url, name="run"))
    RunDir(url).write_state(RunState("run", "/elsewhere/run", RunStatus.PREEMPTED, 1.0, config.to_json()))
    with EventLog(tmp_path / "events.jsonl") as events:
        opening = RunOpening(
            run_terms(config), RunDir(url), events, lambda _line: None, lambda: NewestCheckpoint(False)
        )
        state, _ = opening.open(None)
    assert state.url == url


def test_a_lock_from_another_pid_namespace_of_this_host_is_judged_by_its_lease():
    """A container's supervisor on this host: its pid, missing here, proves nothing (was: DEAD,
    and a second launch took a live run over)."""
    now = time.time()
    here = dataclasses.replace(LockRecord.me(lease=30.0), pid=dead_pid(), renewed_at=now)
    assert here.host == pid_space() and here.judge(now) == LockState.DEAD
    there = dataclasses.replace(here, host=f"{socket.gethostname()}/pidns-1")
    assert there.judge(now) == LockState.ALIVE and not there.provably_dead()
    assert there.judge(now + 31) == LockState.EXPIRED
