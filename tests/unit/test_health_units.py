"""The health check's pure parts: its options, the verdict over the checks, the memory tier's room,
the ranks' GPUs, the GPU probe's lines read back; and the exit code it ends with."""

import json
from pathlib import Path

import pytest

from launcher.agent.health import _gpu_lines, ranks_gpus
from launcher.cli.launch import options_of
from launcher.cli.sections import config_from_options
from launcher.core.config import HealthSection
from launcher.core.health import CheckResult, CheckStatus, HealthReport, tier_room_needed
from launcher.forked.gpu_probe import MARK
from launcher.grammar.errors import ExitCode, NodeUnhealthy, UsageError
from launcher.process.health_command import CommandEnd
from launcher.process.memory_tier import room_for_tier


def _config(*argv: str, environ=None):
    return config_from_options(options_of([*argv, "train.py"]), environ or {})


def test_the_options_reach_the_health_section():
    config = _config("--health-check", "nvidia-smi -q | grep -q OK", "--health-check-timeout", "2m")
    assert config.health == HealthSection("nvidia-smi -q | grep -q OK", 120.0)
    assert _config().health == HealthSection("", 60.0)  # no command: the built-in checks alone


def test_the_environment_sets_the_health_check(monkeypatch):
    monkeypatch.setenv("FTLAUNCH_HEALTH_CHECK", "/opt/check.sh --quick")
    monkeypatch.setenv("FTLAUNCH_HEALTH_CHECK_TIMEOUT", "5s")
    assert _config().health == HealthSection("/opt/check.sh --quick", 5.0)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--health-check-timeout", "0"], "more than 0 seconds"),
        (["--health-check-timeout", "8d"], "at most 7d"),
        (["--health-check-timeout", "soon"], "--health-check-timeout"),
        (["--health-check", "   "], "must name a command"),
    ],
)
def test_bad_health_options_are_usage_errors(argv, words):
    with pytest.raises(UsageError, match=words):
        _config(*argv)


def test_an_unhealthy_node_exits_8_not_a_code_anything_else_uses():
    assert NodeUnhealthy("x").exit_code == ExitCode.UNHEALTHY == 8
    assert [code for code in ExitCode if code == 8] == [ExitCode.UNHEALTHY]


def test_the_first_failure_is_the_verdict_and_unknown_is_never_healthy():
    report = HealthReport(
        (
            CheckResult.passed("--health-check"),
            CheckResult.unknown("gpus", "no GPU"),
            CheckResult.failed("checkpoint storage", "Read-only file system"),
        )
    )
    assert not report.healthy
    assert report.line(3) == "node 3 is unhealthy: checkpoint storage failed: Read-only file system"
    fine = HealthReport((CheckResult.passed("run dir"), CheckResult.unknown("gpus", "no GPU")))
    assert fine.healthy
    assert fine.line(0) == "node 0 health: passed run dir; gpus: unknown (no GPU)"
    assert fine.named(CheckStatus.UNKNOWN) == ("gpus",)


def test_the_tier_needs_room_for_the_second_slot_of_each_rank_at_the_size_seen():
    assert tier_room_needed({}) is None  # no snapshot yet: not known
    assert tier_room_needed({0: [], 1: []}) is None
    assert tier_room_needed({0: [100, 100], 1: [100, 100]}) == 0  # both slots reserved already
    assert tier_room_needed({0: [100], 1: [100, 120]}) == 100
    assert tier_room_needed({0: [100], 1: [50]}) == 150


def _slot(folder: Path, rank: int, slot: int, size: int, index: int = 10) -> None:
    """A slot's record as worker_lib writes it (rank_<r>.<k>.json, written last)."""
    record = {"step": 5, "kind": "parts", "world_size": 2, "size": size, "index_size": index, "metrics": {}}
    (folder / f"rank_{rank}.{slot}.json").write_text(json.dumps(record))


def test_the_tier_room_is_read_from_the_slots_records(tmp_path):
    assert room_for_tier(None).status is CheckStatus.UNKNOWN  # no /dev/shm: no tier at all
    assert room_for_tier(tmp_path).status is CheckStatus.UNKNOWN  # nothing saved yet
    _slot(tmp_path, 0, 0, 1000)
    _slot(tmp_path, 0, 1, 1000)
    (tmp_path / "rank_1.0.json").write_text("{")  # being written: not counted
    assert room_for_tier(tmp_path).status is CheckStatus.PASSED
    _slot(tmp_path, 1, 0, 2**60)  # its second slot could never fit on this disk
    result = room_for_tier(tmp_path)
    assert result.status is CheckStatus.FAILED
    assert "MiB free, the tier's next snapshots need" in result.detail


def test_the_tier_room_counts_the_next_copies_from_other_nodes(tmp_path):
    """--memory-peers: a copy arrives whole before the older one goes, so the room needed grows
    by the newest copy each node sent (here one that could never fit)."""
    _slot(tmp_path, 0, 0, 1000)
    _slot(tmp_path, 0, 1, 1000)
    before = room_for_tier(tmp_path)
    copy = tmp_path / "peers" / "ranks_4_1" / "copy_0_7"
    copy.mkdir(parents=True)
    with open(copy / "rank_4", "wb") as data:
        data.truncate(2**42)  # sparse: no room taken, only its size said (4 TiB)
    (copy / "rank_4.json").write_text("{}")
    assert before.status is CheckStatus.PASSED
    assert room_for_tier(tmp_path).status is CheckStatus.FAILED


def test_the_ranks_gpus_are_the_first_nproc_the_node_sees():
    assert ranks_gpus(2, "nccl", None) == "0,1"
    assert ranks_gpus(2, "nccl", "3,5,7") == "3,5"
    assert ranks_gpus(1, "nccl", "GPU-aa, GPU-bb") == "GPU-aa"
    assert ranks_gpus(4, "gloo", "0,1") is None  # the ranks use no GPU


def test_the_gpu_probes_lines_are_read_among_other_output():
    said = [
        "some CUDA warning",
        MARK + json.dumps({"name": "gpu 0", "status": "passed", "detail": "a small allocation and copy"}),
        MARK + json.dumps({"name": "gpu 0 memory", "status": "failed", "detail": "row remapping pending"}),
    ]
    results = _gpu_lines(CommandEnd(1, [line.strip() for line in said], 0.5))
    assert [(r.name, r.status) for r in results] == [
        ("gpu 0", CheckStatus.PASSED),
        ("gpu 0 memory", CheckStatus.FAILED),
    ]


def test_a_commands_end_is_said_with_its_last_lines():
    lines = [f"line {i}" for i in range(9)]
    assert CommandEnd(3, lines, 0.1).describe(60) == "exit 3; last output: " + " | ".join(lines[-5:])
    assert (
        CommandEnd(None, [], 60.0).describe(60).startswith("no answer within 60 s (--health-check-timeout)")
    )
    assert CommandEnd(-9, [], 1.0).describe(60) == "killed by SIGKILL; no output"
