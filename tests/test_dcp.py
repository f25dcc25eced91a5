"""format="dcp" with FSDP2 (``fully_shard`` on a CPU mesh, gloo): a step saved by 2 ranks loads
at 1, 3 and 4 ranks with every full tensor equal to the saved one, on local disk and on the GCS
emulator; a kill between the shard writes and the commit never makes a later attempt load the
torn step."""

import re

import fsspec
import torch
from conftest import use_emulator
from helpers import ROOT

FSDP = str(ROOT / "examples" / "fsdp_train.py")  # 20 steps, a save every 10


def _starts(stdout: str) -> list:
    return [
        tuple(map(int, s))
        for s in re.findall(r"rank \d+ of (\d+) attempt (\d+) starts at step (\d+)", stdout)
    ]


def _reshard(launcher, tmp_path, url: str, sizes, env=None) -> None:
    saved = launcher.run(
        "--nproc", "2", "--checkpoint-dir", url, FSDP, "--out", str(tmp_path / "saved.pt"),
        env=env, timeout=180,
    )  # fmt: skip
    assert saved.proc.returncode == 0, saved.stderr[-3000:]
    expected = torch.load(tmp_path / "saved.pt")
    for size in sizes:  # the same command at another size: step 20 is loaded, nothing left to train
        out = tmp_path / f"loaded_{size}.pt"
        loaded = launcher.run(
            "--nproc", str(size), "--checkpoint-dir", url, FSDP, "--out", str(out), env=env,
            timeout=180,
        )  # fmt: skip
        assert loaded.proc.returncode == 0, loaded.stderr[-3000:]
        assert sorted(_starts(loaded.stdout)) == [(size, 0, 20)] * size, loaded.stdout
        tensors = torch.load(out)
        assert tensors.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(tensors[name], value), (size, name)
        assert loaded.survivors() == []
    assert saved.survivors() == []


def test_a_dcp_step_saved_by_2_ranks_loads_exactly_at_1_and_4(launcher, tmp_path):
    _reshard(launcher, tmp_path, str(tmp_path / "ckpt"), (1, 4))


def test_a_dcp_step_on_gcs_reshards_too(launcher, tmp_path, gcs_env, monkeypatch):
    use_emulator("gcs", gcs_env, monkeypatch)
    fsspec.filesystem("gcs").mkdir("dcp-reshard")
    _reshard(launcher, tmp_path, "gcs://dcp-reshard/run", (3,), env=gcs_env)


def test_a_kill_between_the_shard_writes_and_the_commit_never_loads_the_torn_step(launcher, tmp_path):
    ckpt = tmp_path / "ckpt"
    launch = launcher.run(
        "--nproc", "2", "--checkpoint-dir", str(ckpt), "--chaos", "kill:at=commit", FSDP,
        "--out", str(tmp_path / "out.pt"), timeout=180,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr[-3000:]
    assert "[injected by --chaos]" in launch.stderr, launch.stderr
    # attempt 0 died with step 10's shards written and no marker: attempt 1 starts afresh
    assert sorted(_starts(launch.stdout)) == [(2, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 0)], launch.stdout
    assert sorted(p.parent.name for p in ckpt.glob("step_*/COMMITTED")) == ["step_10", "step_20"]
    assert launch.survivors() == []


def test_a_crash_reloads_the_dcp_shards_from_the_memory_tier_and_ends_exactly(launcher, tmp_path):
    """Issue 26.2: each rank's shards snapshot into the node's memory every step; a rank killed at
    step 15 resumes every rank from its snapshot of the newest step (not storage's step 10),
    copied into the freshly sharded state in place, and the end equals a run without a crash."""
    clean = launcher.run(
        "--nproc", "2", "--checkpoint-dir", str(tmp_path / "clean"), FSDP,
        "--out", str(tmp_path / "clean.pt"), timeout=180,
    )  # fmt: skip
    assert clean.proc.returncode == 0, clean.stderr[-3000:]
    launch = launcher.run(
        "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--chaos", "kill:at=step:15", FSDP,
        "--memory-every", "1", "--out", str(tmp_path / "crashed.pt"), timeout=180,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr[-3000:]
    loaded = re.findall(r"attempt 1: every rank loaded step (\d+) from (\w+)", launch.stderr)
    assert len(loaded) == 1 and loaded[0][1] == "memory" and int(loaded[0][0]) > 10, launch.stderr
    step = int(loaded[0][0])
    assert sorted(s for s in _starts(launch.stdout) if s[1] == 1) == [(2, 1, step)] * 2, launch.stdout
    expected, tensors = torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "crashed.pt")
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    assert launch.survivors() == [] and clean.survivors() == []
