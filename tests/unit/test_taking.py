"""Taking the run at launch from another host's unexpired lease (launcher/runs/taking.py), on a
real run dir, with an inbox whose waits return at once after doing what the test scripts."""

import dataclasses
import json
import signal
import time

import pytest

from launcher.grammar.errors import RunBusy, SignalReceived
from launcher.runs.directory import LOCK_FILE, LockRecord, RunDir
from launcher.runs.taking import take


class Inbox:
    def __init__(self, received=(), during_wait=lambda: None) -> None:
        self.received = list(received)
        self.waits = 0
        self._during_wait = during_wait

    def wait(self, timeout: float) -> None:
        self.waits += 1
        self._during_wait()

    def name(self, index: int) -> str:
        return signal.Signals(self.received[index]).name


def _lock(folder, **fields) -> LockRecord:
    theirs = {"host": "elsewhere", "pid": 1, "token": "theirs", **fields}
    record = dataclasses.replace(LockRecord.me(lease=60.0), **theirs)
    folder.mkdir(exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps(dataclasses.asdict(record)))
    return record


def test_a_signal_before_the_wait_ends_it_at_once_and_takes_nothing(tmp_path):
    held = _lock(tmp_path / "run")
    inbox = Inbox(received=[signal.SIGTERM])
    with pytest.raises(SignalReceived):
        take(RunDir(str(tmp_path / "run")), 60.0, inbox, lambda _line: None)
    assert inbox.waits == 0 and RunDir(str(tmp_path / "run")).read_lock() == held


def test_a_renewal_during_the_wait_is_refused_as_alive(tmp_path):
    held = _lock(tmp_path / "run")
    inbox = Inbox(during_wait=lambda: _lock(tmp_path / "run", renewed_at=held.renewed_at + 20.0))
    said = []
    with pytest.raises(RunBusy, match="it renewed its lease while this launch waited: it is alive"):
        take(RunDir(str(tmp_path / "run")), 60.0, inbox, said.append)
    assert inbox.waits == 1 and "waiting up to 61 s for its lease to expire" in said[0]


def test_a_lock_taken_by_a_third_during_the_wait_is_refused_without_saying_renewed(tmp_path):
    _lock(tmp_path / "run")
    inbox = Inbox(during_wait=lambda: _lock(tmp_path / "run", host="third", token="third"))
    with pytest.raises(RunBusy) as refused:
        take(RunDir(str(tmp_path / "run")), 60.0, inbox, lambda _line: None)
    assert "third pid 1" in str(refused.value) and "while this launch waited" not in str(refused.value)


def test_a_lock_released_during_the_wait_is_taken(tmp_path):
    _lock(tmp_path / "run")
    inbox = Inbox(during_wait=lambda: (tmp_path / "run" / LOCK_FILE).unlink())
    directory = RunDir(str(tmp_path / "run"))
    assert take(directory, 60.0, inbox, lambda _line: None) is None
    assert directory.read_lock().token == directory.holder.token
    directory.release()


def test_a_lease_of_hours_is_refused_at_once_and_a_clock_far_ahead_waits_one_lease(tmp_path):
    _lock(tmp_path / "run", lease=86400.0)
    inbox = Inbox()
    with pytest.raises(RunBusy, match="lasts 86400 s"):
        take(RunDir(str(tmp_path / "run")), 60.0, inbox, lambda _line: None)
    assert inbox.waits == 0

    _lock(tmp_path / "run", renewed_at=time.time() + 1e7)
    said = []
    inbox = Inbox(during_wait=lambda: _lock(tmp_path / "run", host="third", token="third"))
    with pytest.raises(RunBusy):
        take(RunDir(str(tmp_path / "run")), 60.0, inbox, said.append)
    assert "waiting up to 61 s" in said[0], said
