"""Per-rank logs and console lines; DataLoader workers stopped with their rank."""

import re

from helpers import ACTOR, SCRIPTS


def test_console_lines_are_whole_and_prefixed(launcher):
    launch = launcher.run("--nproc", "3", str(ACTOR), "--spam", "3000", "--no-newline")
    assert launch.proc.returncode == 0, launch.stderr

    pattern = re.compile(r"^\[(\d)\] rank \1 (line \d+ x{200}|attempt 0 started|last words)$")
    lines = launch.stdout.splitlines()
    bad = [line for line in lines if not pattern.match(line)]
    assert bad == []
    for rank in range(3):
        assert sum(line.startswith(f"[{rank}] rank {rank} line ") for line in lines) == 3000
        assert f"[{rank}] rank {rank} last words" in lines  # a final line without its newline
        log = (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()
        assert log.count(f"rank {rank} line ") == 3000 and log.endswith(f"rank {rank} last words")


def test_console_ranks_filter_keeps_every_rank_in_its_file(launcher):
    launch = launcher.run("--nproc", "3", "--console-ranks", "1", str(ACTOR))
    assert launch.proc.returncode == 0, launch.stderr
    assert "[1] rank 1 attempt 0 started" in launch.stdout
    assert "[0]" not in launch.stdout and "[2]" not in launch.stdout
    for rank in range(3):
        assert "attempt 0 started" in (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()


def test_each_attempt_has_its_own_logs(launcher):
    launch = launcher.run("--nproc", "2", str(ACTOR), "--fail", "exit")
    assert launch.proc.returncode == 0, launch.stderr
    assert "about to fail" in (launch.log_dir / "attempt_0" / "rank_1.log").read_text()
    assert "about to fail" not in (launch.log_dir / "attempt_1" / "rank_1.log").read_text()


def test_dataloader_workers_are_stopped_with_their_rank(launcher, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    launch = launcher.run(
        "--nproc", "2", "--max-failures", "0", str(SCRIPTS / "dataloader.py"), env={"READY_DIR": str(ready)}
    )
    assert launch.proc.returncode == 1, launch.stderr
    assert "rank 1: loader workers up, dying" in launch.stdout
    assert len(list(ready.glob("rank_*.loader_*.pid"))) == 4  # 2 ranks x 2 loader processes
    assert launch.survivors() == []


def test_a_closed_console_does_not_stall_the_workers(launcher):
    # As in `ftlaunch ... | head`: the reader goes away, the workers keep running, files stay whole.
    launch = launcher.start("--nproc", "2", str(ACTOR), "--spam", "20000")
    launch.proc.stdout.close()
    assert launch.proc.wait(timeout=60) == 0
    for rank in range(2):
        log = (launch.log_dir / "attempt_0" / f"rank_{rank}.log").read_text()
        assert log.count(f"rank {rank} line ") == 20000
    assert launch.survivors() == []
