"""The rule for what a supervisor keeps in /dev/shm (launcher.core.owned): a cleaner removes
only what it can lock; a held lock, a name in the making and an older ftlaunch's leftover are kept.
flock locks belong to an open file, so one process can play owner and cleaner with two opens."""

import logging
import os
import tempfile
from pathlib import Path

from helpers import dead_pid

from launcher.core import owned
from launcher.hangs.board import HeartbeatBoard
from launcher.process.memory_tier import MemoryTier

KIND = "ftlaunch-test-"


def test_a_held_folder_is_kept_and_a_released_one_removed(tmp_path):
    fd, folder = owned.owned_folder(tmp_path, KIND)
    assert folder.name.startswith(f"{KIND}owned-{os.getpid()}-") and (folder / owned.OWNER).is_file()
    (folder / "rank_0.0").write_bytes(b"snapshot")
    owned.remove_unowned(tmp_path, KIND)
    assert (folder / "rank_0.0").read_bytes() == b"snapshot"
    os.close(fd)  # as the kernel does when its owner dies, in whatever PID namespace
    owned.remove_unowned(tmp_path, KIND)
    assert not folder.exists()


def test_a_held_file_is_kept_and_a_released_one_removed(tmp_path):
    fd, path = owned.owned_file(tmp_path, KIND, tag="3-")
    assert path.name.startswith(f"{KIND}owned-{os.getpid()}-3-")
    owned.remove_unowned(tmp_path, KIND)
    assert path.is_file()
    os.close(fd)
    owned.remove_unowned(tmp_path, KIND)
    assert not path.exists()


def test_a_folder_without_its_owner_file_yet_is_taken_and_its_maker_sees_it_lost(tmp_path):
    """The owner's first step (the folder) done, not its second (the locked .owner): a cleaner
    removes it, and the owner's lock then fails, so that it makes another."""
    folder = Path(tempfile.mkdtemp(prefix=f"{KIND}owned-{dead_pid()}-", dir=tmp_path))
    owned.remove_unowned(tmp_path, KIND)
    assert not folder.exists()
    assert owned._lock(folder / owned.OWNER, create=True) is None


def test_an_owner_that_opened_before_a_cleaner_removed_it_sees_it_lost(tmp_path):
    fd, path = owned.owned_file(tmp_path, KIND)
    os.close(fd)  # unlocked: as between mkstemp and flock
    late = os.open(path, os.O_RDONLY)
    try:
        owned.remove_unowned(tmp_path, KIND)
        assert not path.exists()
        assert not owned._hold(late, path)  # the lock is had, but on a file no name leads to
    finally:
        os.close(late)


def test_what_an_older_ftlaunch_left_is_kept_and_said_once(tmp_path, caplog):
    """No lock to judge by: its pid missing here may be another PID namespace's live supervisor."""
    older = tmp_path / f"ftlaunch-memory-{dead_pid()}-left"
    older.mkdir()
    board = tmp_path / f"ftlaunch-heartbeat-{dead_pid()}-0-left"
    board.write_bytes(b"")
    with caplog.at_level(logging.INFO, logger=owned.__name__):
        tier = MemoryTier(shm=tmp_path)
        tier.close()
        MemoryTier(shm=tmp_path).close()
        HeartbeatBoard(1, attempt=0, shm=str(tmp_path)).close()
    assert older.is_dir() and board.is_file()  # were: removed, their pid being absent here
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and str(older) in said[0] and str(board) in said[1], said
    assert "another PID namespace" in said[0]


def test_a_link_is_never_followed(tmp_path):
    target = tmp_path / "someone_elses"
    target.mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / f"{KIND}owned-1-x").symlink_to(target)
    owned.remove_unowned(shm, KIND)
    assert (shm / f"{KIND}owned-1-x").is_symlink() and list(target.iterdir()) == []


def test_the_tier_and_the_board_hold_their_locks_until_closed(tmp_path):
    tier, board = MemoryTier(shm=tmp_path), HeartbeatBoard(2, attempt=1, shm=str(tmp_path))
    assert tier.folder is not None and board.path.parent == tmp_path
    owned.remove_unowned(tmp_path, "ftlaunch-memory-")
    owned.remove_unowned(tmp_path, "ftlaunch-heartbeat-")
    assert tier.folder.is_dir() and board.path.stat().st_size == 2 * 256
    board.close()
    tier.close()
    assert list(tmp_path.iterdir()) == []
