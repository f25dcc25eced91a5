"""The run dir's writer thread on a real folder: newest write wins, a lost run is never written
again, and storage that does not answer ends the run after the lease, never the caller's wait.
Storage that hangs is a FIFO in place of lock.json: reading it blocks until someone writes it."""

import dataclasses
import json
import os
import time

import pytest
from helpers import until

from launcher.grammar.errors import RunLost, StorageLost
from launcher.runs import writer as writer_module
from launcher.runs.directory import LOCK_FILE, RunDir
from launcher.runs.writer import RunDirWriter


def _held(tmp_path, lease: float) -> RunDir:
    directory = RunDir(str(tmp_path / "run"), retries=False)
    directory.acquire(lease=lease)
    return directory


def _answer(lock, held: bytes) -> None:
    """Storage answers again: the read stuck on the FIFO gets the lock, and the path is a plain
    file again for every later read."""
    fifo = os.open(lock, os.O_WRONLY)  # the stuck reader has it open: this does not block
    plain = lock.with_suffix(".plain")
    plain.write_bytes(held)
    os.replace(plain, lock)
    try:
        os.write(fifo, held)
    except BrokenPipeError:  # fsspec's reader gave up on the FIFO (it seeks): it retries on the file
        pass
    os.close(fifo)


def test_the_newest_write_of_a_file_wins_and_the_lock_goes_at_close(tmp_path):
    directory = _held(tmp_path, lease=30.0)
    said = []
    writer = RunDirWriter(directory, lease=30.0, say=said.append)
    for n in range(50):
        writer.submit("progress.json", json.dumps({"n": n}).encode())
    assert writer.flush(10.0)
    assert json.loads((tmp_path / "run" / "progress.json").read_text()) == {"n": 49}
    writer.check()
    writer.close(10.0)
    assert not (tmp_path / "run" / LOCK_FILE).exists() and said == []


def test_a_run_taken_over_is_never_written_again(tmp_path):
    directory = _held(tmp_path, lease=30.0)
    writer = RunDirWriter(directory, lease=30.0, say=lambda line: None)
    theirs = dataclasses.replace(directory.read_lock(), host="elsewhere", token="theirs")
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(dataclasses.asdict(theirs)))
    writer.submit("run.json", b"{}")
    writer.flush(10.0)
    with pytest.raises(RunLost, match="is now held by elsewhere"):
        writer.check()
    writer.submit("run.json", b"{}")
    writer.close(10.0)
    assert not (tmp_path / "run" / "run.json").exists()  # nothing written after it was lost
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["token"] == "theirs"  # theirs stays


def test_storage_that_does_not_answer_ends_the_run_after_the_lease_and_no_wait_hangs(tmp_path):
    directory = _held(tmp_path, lease=1.0)
    lock = tmp_path / "run" / LOCK_FILE
    held = lock.read_bytes()
    lock.unlink()
    os.mkfifo(lock)  # the writer's next look at the lock blocks until someone writes it
    writer = RunDirWriter(directory, lease=1.0, say=lambda line: None)
    writer.submit("run.json", b"{}")
    try:
        assert not writer.flush(0.5)  # bounded, though the thread is stuck
        deadline = time.monotonic() + 10.0
        with pytest.raises(StorageLost, match=r"run dir \S+ has not answered for \d+ s.*--lease 1 s"):
            while time.monotonic() < deadline:
                writer.check()
                time.sleep(0.05)
        started = time.monotonic()
        writer.close(0.2)  # gives up on the stuck thread
        assert time.monotonic() - started < 5.0
    finally:
        _answer(lock, held)
    until(lambda: not writer._thread.is_alive())  # once storage answers, the thread ends


def test_a_stopped_supervisor_does_not_blame_storage_for_its_own_silence(tmp_path, monkeypatch):
    """A supervisor stopped (SIGSTOP, a frozen VM) longer than the lease asked nothing meanwhile:
    its next check must give the thread the chance to hear from storage."""
    monkeypatch.setattr(writer_module, "_STALL_S", 0.2)
    directory = _held(tmp_path, lease=1.0)
    lock = tmp_path / "run" / LOCK_FILE
    held = lock.read_bytes()
    lock.unlink()
    os.mkfifo(lock)
    writer = RunDirWriter(directory, lease=1.0, say=lambda line: None)
    try:
        writer.check()
        time.sleep(1.5)  # "stopped": no check for longer than the lease
        writer.check()  # the gap is this process's own, not the storage's
    finally:
        _answer(lock, held)
    writer.submit("run.json", b"{}")
    assert writer.flush(10.0)  # storage answers again: written
    writer.check()
    writer.close(10.0)


def test_a_loop_busy_elsewhere_while_storage_answered_excuses_nothing_after(tmp_path, monkeypatch):
    """Regression (the chaos matrix): the loop did not ask for a minute while the fork server
    started (the thread heard from storage all along); storage died right after, and the whole
    minute was taken off the silence: the run ended a minute late."""
    monkeypatch.setattr(writer_module, "_STALL_S", 0.2)
    directory = _held(tmp_path, lease=0.5)
    lock = tmp_path / "run" / LOCK_FILE
    held = lock.read_bytes()
    writer = RunDirWriter(directory, lease=0.5, say=lambda line: None)
    writer.check()
    time.sleep(4.0)  # the loop busy elsewhere; the thread renews the lease meanwhile
    writer.check()
    lock.unlink()
    os.mkfifo(lock)  # storage hangs from now on
    died = time.monotonic()
    try:
        with pytest.raises(StorageLost):
            # The lease and a look (0.7 s), with room for a loaded machine; the defect took the
            # busy 4 s off the silence, and would need 4.5 s.
            while time.monotonic() - died < 3.5:
                writer.check()
                time.sleep(0.02)
    finally:
        _answer(lock, held)
    writer.close(10.0)
