"""What workers see: torchrun's variables with torchrun's meaning, and a working env:// init."""

import json
import os
import subprocess
import sys
import uuid

from helpers import ACTOR, MARKER, ROOT, SCRIPTS, processes_with_marker

# Values that differ between two runs by design (ports, run ids, paths).
RUN_SPECIFIC = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
# Set by torchrun's agent on itself for its own signal handling; workers inherit it by accident.
AGENT_ONLY = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
OURS = {
    "GRPC_VERBOSITY",  # ERROR unless set: grpc's INFO lines off the console (docs/environment.md)
    "FTLAUNCH_ATTEMPT",
    "FTLAUNCH_BACKEND",
    "FTLAUNCH_HEARTBEAT_FILE",
    "FTLAUNCH_CHECKPOINT_URL",
    "FTLAUNCH_MEMORY_DIR",
    "TORCH_FR_BUFFER_SIZE",  # 512 unless set: torch's flight recorder, for the stragglers
    MARKER,
}


def _added_vars(env_file, base):
    env = json.loads(env_file.read_text())
    return {k: v for k, v in env.items() if base.get(k) != v}


def _run_torchrun(env_dir, marker):
    env = {**os.environ, MARKER: marker}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        str(ACTOR),
        "--env-dir",
        str(env_dir),
    ]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)


def test_workers_see_what_torchrun_gives(launcher, tmp_path):
    marker = uuid.uuid4().hex
    _run_torchrun(tmp_path / "torchrun", marker)
    assert processes_with_marker(marker) == []
    # --max-failures 0 is torchrun's default --max-restarts 0, so even that value must match.
    launch = launcher.run(
        "--nproc", "3", "--max-failures", "0", str(ACTOR), "--env-dir", str(tmp_path / "ftlaunch")
    )
    assert launch.proc.returncode == 0, launch.stderr

    base = dict(os.environ)
    for rank in range(3):
        theirs = _added_vars(tmp_path / "torchrun" / f"rank_{rank}.attempt_0.json", base)
        ours = _added_vars(tmp_path / "ftlaunch" / f"rank_{rank}.attempt_0.json", base)
        assert set(theirs) - AGENT_ONLY - {MARKER} == set(ours) - OURS
        for name in set(theirs) - RUN_SPECIFIC - AGENT_ONLY - {MARKER}:
            assert ours[name] == theirs[name], name
        assert ours["RANK"] == ours["LOCAL_RANK"] == str(rank)
        assert ours["FTLAUNCH_BACKEND"] == "gloo"
        assert ours["TORCHELASTIC_ERROR_FILE"] == str(
            launch.log_dir.resolve() / "attempt_0" / f"rank_{rank}.error.json"
        )
    assert (
        len(
            {
                json.loads((tmp_path / "ftlaunch" / f"rank_{r}.attempt_0.json").read_text())["MASTER_PORT"]
                for r in range(3)
            }
        )
        == 1
    )


def test_env_init_and_gloo_all_reduce_work_across_a_restart(launcher):
    launch = launcher.run("--nproc", "3", str(SCRIPTS / "allreduce.py"))
    assert launch.proc.returncode == 0, launch.stderr
    for attempt in (0, 1):
        for rank in range(3):
            assert f"[{rank}] rank {rank} attempt {attempt} all_reduce ok: 3.0" in launch.stdout


def test_one_rank_is_a_group_too(launcher):
    """As init_process_group under torchrun --nproc-per-node 1: DDP and dist.get_rank() work."""
    launch = launcher.run("--nproc", "1", str(SCRIPTS / "one_rank.py"))
    assert launch.proc.returncode == 0, launch.stderr
    assert "[0] rank 0 of 1: DDP step done (1 rank(s))" in launch.stdout
    alone = subprocess.run([sys.executable, str(SCRIPTS / "one_rank.py")], capture_output=True, text=True)
    assert alone.returncode == 0 and "rank 0 of 1: DDP step done" in alone.stdout, alone.stderr  # no launcher
    assert launch.survivors() == []
