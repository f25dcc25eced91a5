"""format="dcp" with FSDP2 (``fully_shard`` on a CPU mesh, gloo): a step saved by 2 ranks loads
at 1, 3 and 4 ranks with every full tensor equal to the saved one, on local disk and on the GCS
emulator; a kill between the shard writes and the commit never makes a later attempt load the
torn step."""

import re

import fsspec
import pytest
import torch
from conftest import use_emulator
from helpers import ROOT, Launcher

FSDP = str(ROOT / "examples" / "fsdp_train.py")  # 20 steps, a save every 10


def _starts(stdout: str) -> list:
    return [
        tuple(map(int, s))
        for s in re.findall(r"rank \d+ of (\d+) attempt (\d+) starts at step (\d+)", stdout)
    ]


def _save(launcher, tmp_path, url: str, env=None) -> dict:
    """A 2-rank job to its end (step 20, saved): its full tensors."""
    saved = launcher.run(
        "--nproc", "2", "--checkpoint-dir", url, FSDP, "--out", str(tmp_path / "saved.pt"),
        env=env, timeout=180,
    )  # fmt: skip
    assert saved.proc.returncode == 0, saved.stderr[-3000:]
    assert saved.survivors() == []
    return torch.load(tmp_path / "saved.pt")


@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory):
    """``_save`` on local disk, once per module (its tests share an xdist group): (url, tensors)."""
    tmp_path = tmp_path_factory.mktemp("fsdp2")
    runner = Launcher(tmp_path)
    try:
        url = str(tmp_path / "ckpt")
        expected = _save(runner, tmp_path, url)
    finally:
        leaked = runner.cleanup()
    assert not leaked, leaked
    return url, expected


def _reshard(launcher, tmp_path, url: str, sizes, expected: dict, env=None) -> None:
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


@pytest.mark.xdist_group("fsdp2")
def test_a_dcp_step_saved_by_2_ranks_loads_exactly_at_1_and_4(launcher, tmp_path, saved_by_2):
    url, expected = saved_by_2
    _reshard(launcher, tmp_path, url, (1, 4), expected)


def test_a_dcp_step_on_gcs_reshards_too(launcher, tmp_path, gcs_env, monkeypatch):
    use_emulator("gcs", gcs_env, monkeypatch)
    fsspec.filesystem("gcs").mkdir("dcp-reshard")
    url = "gcs://dcp-reshard/run"
    _reshard(launcher, tmp_path, url, (3,), _save(launcher, tmp_path, url, env=gcs_env), env=gcs_env)


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


@pytest.mark.xdist_group("fsdp2")
def test_a_crash_reloads_the_dcp_shards_from_the_memory_tier_and_ends_exactly(launcher, tmp_path, saved_by_2):
    """Issue 26.2: each rank's shards snapshot into the node's memory every step; a rank killed at
    step 15 resumes every rank from its snapshot of the newest step (not storage's step 10),
    copied into the freshly sharded state in place, and the end equals a run without a crash."""
    launch = launcher.run(
        "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--chaos", "kill:at=step:15", FSDP,
        "--memory-every", "1", "--out", str(tmp_path / "crashed.pt"), timeout=180,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr[-3000:]
    loaded = re.findall(r"attempt 1: every rank loaded step (\d+) from (\w+)", launch.stderr)
    assert len(loaded) == 1 and loaded[0][1] == "memory" and int(loaded[0][0]) > 10, launch.stderr
    step = int(loaded[0][0])
    assert sorted(s for s in _starts(launch.stdout) if s[1] == 1) == [(2, 1, step)] * 2, launch.stdout
    expected, tensors = saved_by_2[1], torch.load(tmp_path / "crashed.pt")
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    assert launch.survivors() == []
