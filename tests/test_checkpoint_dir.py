"""Directory mode: any files, committed per step, loaded as one local directory per node."""

import uuid
from pathlib import Path

from helpers import SCRIPTS

from worker_lib.checkpoint.directory import latest_directory, node_cache_root, save_directory
from worker_lib.checkpoint.manager import CheckpointManager, LocalChannel
from worker_lib.core.storage import Storage


def test_files_round_trip_and_a_damaged_file_falls_back(storage, tmp_path, caplog):
    manager = CheckpointManager(Storage(storage.url), 0, 1, LocalChannel())
    run_id = f"test-{uuid.uuid4().hex}"
    for step in (1, 2):
        with save_directory(manager, step, {"loss": 1.0 / step}) as folder:
            Path(folder, "weights.bin").write_bytes(bytes([step]) * 5000)
            Path(folder, "sub").mkdir()
            Path(folder, "sub", "info.txt").write_text(f"step {step}")
    manager.wait()

    newest = latest_directory(manager, run_id, attempt=0)
    assert newest.step == 2
    found = Path(newest.path)
    assert (found / "weights.bin").read_bytes() == bytes([2]) * 5000
    assert (found / "sub" / "info.txt").read_text() == "step 2"

    manager.storage.write_bytes("step_2/files/weights.bin", b"torn")
    fallback = latest_directory(manager, run_id, attempt=1)
    assert fallback.step == 1
    assert (Path(fallback.path) / "sub" / "info.txt").read_text() == "step 1"
    assert "weights.bin has 4 bytes" in caplog.text


def test_every_rank_finds_every_file_fetched_once_per_node(launcher, storage, tmp_path):
    # Unique on the node: the node cache is keyed by run id, and tmp_path's name is the same in two
    # test workers running two storages of this test at once (each numbers its own folders).
    run_id = f"dir-{uuid.uuid4().hex}"
    launch = launcher.run(
        "--nproc",
        "3",
        "--run-id",
        run_id,
        "--checkpoint-dir",
        storage.url,
        str(SCRIPTS / "dir_ckpt.py"),
        env=storage.env,
        timeout=120,
    )

    assert launch.proc.returncode == 0, launch.stderr
    expected = (
        "found ['meta/config.json', 'shard_0.bin', 'shard_1.bin', 'shard_2.bin'] sizes [20000, 20000, 20000]"
    )
    for rank in range(3):
        assert f"[{rank}] rank {rank} {expected}" in launch.stdout
    assert "[0] rank 0 committed; dying" in launch.stdout
    logs = [(launch.log_dir / "attempt_1" / f"rank_{r}.log").read_text() for r in range(3)]
    assert sum("files verified" in log for log in logs) == 1  # one rank did it for the node
    assert not node_cache_root(run_id).exists()  # ft.shutdown() cleaned up after the fetch
    assert launch.survivors() == []
