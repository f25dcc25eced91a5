"""--chaos on real runs: the faults land where the SPEC says, are marked as injected everywhere
(events, run.json, the summary), do not spend the failure budget unless asked, and the run ends
as it would have without them."""

import json
from pathlib import Path

import torch
from helpers import SCRIPTS

TRAIN = str(SCRIPTS / "ckpt_train.py")
BEATER = str(SCRIPTS / "beater.py")


def _run_state(launch) -> dict:
    return json.loads((Path(launch.run_url()) / "run.json").read_text())


def _train(launcher, tmp_path, name, *extra):
    out = tmp_path / f"{name}.pt"
    launch = launcher.run("--nproc", "2", "--run-name", name, *extra, TRAIN, "--out", str(out), timeout=180)
    return launch, out


def test_injected_kill_and_segv_do_not_spend_the_budget_and_the_run_ends_bit_identical(launcher, tmp_path):
    clean, clean_out = _train(launcher, tmp_path, "clean")
    assert clean.proc.returncode == 0, clean.stderr
    spec = "kill:rank=1,at=step:7;segv:rank=0,at=step:13"
    launch, out = _train(launcher, tmp_path, "chaos", "--max-failures", "0", "--chaos", spec)
    assert launch.proc.returncode == 0, launch.stderr  # two failures, none counted
    injected = launch.events("chaos_injected")
    assert [(e["rank"], e["signal"]) for e in injected] == [(1, "SIGKILL"), (0, "SIGSEGV")]
    assert injected[0]["step"] >= 7 and injected[1]["step"] >= 13
    assert "seed=" in launch.events("run_start")[0]["config"]["chaos"]  # the plan, to replay it
    state = _run_state(launch)
    attempts = state["attempts"]
    assert [a["outcome"] for a in attempts] == ["FAILED", "FAILED", "SUCCEEDED"]
    assert [a["injected"] for a in attempts] == [True, True, False]
    first_failures = [f for f in attempts[0]["failures"] if f["injected"]]
    assert [f["rank"] for f in first_failures] == [1]
    assert "chaos: SIGKILL to rank 1" in launch.stderr
    assert "[injected by --chaos]" in launch.stderr  # the summary's attempt lines
    assert "an injected failure, not counted" in launch.stderr
    a, b = torch.load(clean_out), torch.load(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert launch.survivors() == [] and clean.survivors() == []


def test_with_chaos_counts_an_injected_failure_spends_the_budget(launcher, tmp_path):
    launch, _ = _train(
        launcher,
        tmp_path,
        "counted",
        "--max-failures",
        "0",
        "--chaos",
        "kill:rank=1,at=step:3",
        "--chaos-counts",
    )
    assert launch.proc.returncode == 1, launch.stderr
    assert "no failures allowed" in launch.stderr
    assert [a["injected"] for a in _run_state(launch)["attempts"]] == [True]
    assert launch.survivors() == []


def test_an_injected_hang_is_detected_as_a_hang_of_a_stopped_process(launcher, tmp_path):
    launch = launcher.run(
        "--nproc",
        "2",
        "--heartbeat-timeout",
        "2s",
        "--max-failures",
        "0",
        "--chaos",
        "hang:rank=1,at=step:10",
        BEATER,
        "--collective",
        "--steps",
        "40",
        timeout=120,
    )
    assert launch.proc.returncode == 0, launch.stderr
    (injected,) = launch.events("chaos_injected")
    assert (injected["rank"], injected["signal"]) == (1, "SIGSTOP")
    failures = _run_state(launch)["attempts"][0]["failures"]
    hung = [f for f in failures if f["rank"] == 1]
    assert hung and hung[0]["cause"] == "hang" and hung[0]["injected"]
    assert "process stopped" in hung[0]["detail"]
    assert launch.survivors() == []


def test_a_kill_during_a_save_lands_while_the_save_is_in_flight_and_loses_nothing(launcher, tmp_path):
    launch = launcher.run(
        "--nproc",
        "2",
        "--max-failures",
        "0",
        "--chaos",
        "kill:rank=0,at=save",
        BEATER,
        "--steps",
        "12",
        "--save-every",
        "3",
        "--save-mb",
        "128",
        "--save-at",
        "7",
        timeout=120,
    )
    assert launch.proc.returncode == 0, launch.stderr
    (injected,) = launch.events("chaos_injected")
    assert injected["saving"] and injected["rank"] == 0
    # The restarted group resumed from a committed step, and the run finished every step.
    assert "rank 0 done after 12 steps" in launch.stdout
    starts = [
        int(line.rsplit(" ", 1)[1])
        for line in launch.stdout.splitlines()
        if "attempt 1 starts at step" in line
    ]
    assert starts and all(s <= injected["step"] + 1 for s in starts)
    assert launch.survivors() == []


def test_a_bad_spec_is_refused_before_any_worker_starts(launcher, tmp_path):
    for args, env in (
        (["--chaos", "kill:every=5s,jitter=9s"], None),
        ([], {"FTLAUNCH_CHAOS": "explode:at=1s"}),
        (["--chaos", "kill:rank=7,at=1s"], None),
    ):
        launch = launcher.run("--nproc", "2", *args, BEATER, env=env, timeout=60)
        assert launch.proc.returncode == 2, launch.stderr
        errors = [line for line in launch.stderr.splitlines() if "--chaos" in line]
        assert len(errors) == 1, launch.stderr
        assert not (launch.log_dir / "events.jsonl").exists()
        assert launch.survivors() == []
