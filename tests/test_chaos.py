"""--chaos on real runs: the faults land where the SPEC says, are marked as injected everywhere
(events, run.json, the summary), do not spend the failure budget unless asked, and the run ends
as it would have without them."""

import torch
from helpers import SCRIPTS

from launcher.core.events import ChaosInjected, RunStart
from worker_lib.core import contract

TRAIN = str(SCRIPTS / "ckpt_train.py")
BEATER = str(SCRIPTS / "beater.py")


def _train(launcher, tmp_path, name, *extra):
    out = tmp_path / f"{name}.pt"
    script = [TRAIN, "--out", str(out), "--step-time", "0.1"]
    launch = launcher.run("--nproc", "2", "--run-name", name, *extra, *script, timeout=180)
    return launch, out


def test_injected_kill_and_segv_do_not_spend_the_budget_and_the_run_ends_bit_identical(launcher, tmp_path):
    clean, clean_out = _train(launcher, tmp_path, "clean")
    assert clean.proc.returncode == 0, clean.stderr
    spec = "kill:rank=1,at=step:7;segv:rank=0,at=step:13"
    launch, out = _train(launcher, tmp_path, "chaos", "--max-failures", "0", "--chaos", spec)
    assert launch.proc.returncode == 0, launch.stderr  # two failures, none counted
    injected = launch.events(ChaosInjected)
    assert [(e.rank, e.signal) for e in injected] == [(1, "SIGKILL"), (0, "SIGSEGV")]
    assert injected[0].step >= 7 and injected[1].step >= 13
    assert "seed=" in launch.events(RunStart)[0].config["chaos"]  # the plan, to replay it
    # Steps take milliseconds: both faults may land in one attempt, or in two.
    attempts = launch.run_state().attempts
    outcomes = [a.outcome for a in attempts]
    assert outcomes[-1] == "SUCCEEDED" and set(outcomes[:-1]) == {"FAILED"} and len(outcomes) in (2, 3)
    assert all(a.injected for a in attempts[:-1])
    marked = {(f.rank, f.detail.split(": ", 1)[1]) for a in attempts for f in a.failures if f.injected}
    assert marked == {
        (1, "Signal 9 (SIGKILL) [injected by --chaos]"),
        (0, "Signal 11 (SIGSEGV) [injected by --chaos]"),
    }
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
    assert [a.injected for a in launch.run_state().attempts] == [True]
    assert launch.survivors() == []


def test_worker_lib_carries_out_faults_at_save_points_and_in_the_training_thread(launcher, tmp_path):
    """A death half-way through writing a part, one between a part and the commit, and an
    exception: each step they cut short is never committed, and the run ends as without them."""
    clean, clean_out = _train(launcher, tmp_path, "clean")
    assert clean.proc.returncode == 0, clean.stderr
    spec = "kill:rank=1,at=save;segv:rank=0,at=commit;raise:rank=1,at=step:17"
    launch, out = _train(launcher, tmp_path, "chaos", "--max-failures", "0", "--chaos", spec)
    assert launch.proc.returncode == 0, launch.stderr
    injected = launch.events(ChaosInjected)
    # A request whose rank was stopped before it was carried out (a peer died first in the same
    # save) is asked again in the next attempt: each fault is asked for until it lands, once.
    asked = list(dict.fromkeys((e.signal, e.via) for e in injected))
    assert asked == [("SIGKILL", "worker_lib"), ("SIGSEGV", "worker_lib"), ("raise", "worker_lib")]
    assert len(injected) - 3 == launch.stderr.count("; asked again"), launch.stderr
    # The save and commit requests wait in the slots from the start: both may land in the first
    # save, or one after the other.
    attempts = launch.run_state().attempts
    outcomes = [a.outcome for a in attempts]
    assert outcomes[-1] == "SUCCEEDED" and set(outcomes[:-1]) == {"FAILED"} and len(outcomes) in (3, 4)
    assert all(a.injected for a in attempts[:-1])
    logs = "".join(p.read_text() for p in launch.log_dir.glob("attempt_*/rank_*.log"))
    assert "SIGKILL half-way through writing its checkpoint part" in logs
    assert "SIGSEGV after writing its part of step" in logs
    assert "ChaosError: injected by ftlaunch --chaos" in logs
    a, b = torch.load(clean_out), torch.load(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert launch.survivors() == [] and clean.survivors() == []


def test_injected_hangs_a_stopped_rank_and_a_sleeping_one_are_found_as_hangs(launcher, tmp_path):
    launch = launcher.run(
        "--nproc",
        "2",
        "--heartbeat-timeout",
        "2s",
        "--max-failures",
        "0",
        "--chaos",
        "hang:rank=1,at=step:10;sleep:rank=0,at=step:25",
        BEATER,
        "--collective",
        "--steps",
        "40",
        timeout=120,
    )
    assert launch.proc.returncode == 0, launch.stderr
    injected = launch.events(ChaosInjected)
    assert [(e.rank, e.signal) for e in injected] == [(1, "SIGSTOP"), (0, "sleep")]
    attempts = launch.run_state().attempts
    assert [a.outcome for a in attempts] == ["FAILED", "FAILED", "SUCCEEDED"]
    stopped = [f for f in attempts[0].failures if f.rank == 1]
    assert stopped[0].cause == "hang" and stopped[0].injected and "process stopped" in stopped[0].detail
    asleep = [f for f in attempts[1].failures if f.rank == 0]
    assert asleep[0].cause == "hang" and asleep[0].injected and "in act (chaos.py" in asleep[0].detail
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


def test_chaos_from_the_environment_announces_itself_at_start_in_status_and_in_the_summary(
    launcher, tmp_path
):
    """A forgotten FTLAUNCH_CHAOS in a shell profile must never inject faults unannounced."""
    script = [BEATER, "--steps", "20", "--step-time", "0.02"]
    chaos = {"FTLAUNCH_CHAOS": "sleep:rank=0,at=600s"}
    launch = launcher.run("--nproc", "1", "--run-name", "env", *script, env=chaos, timeout=120)
    assert launch.proc.returncode == 0, launch.stderr
    lines = launch.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if "chaos (FTLAUNCH_CHAOS in the environment)" in line)
    assert "injecting sleep:rank=0,at=600s" in lines[start] and "do not count" in lines[start]
    assert start < next(i for i, line in enumerate(lines) if "attempt 0: starting" in line)
    assert "  chaos (FTLAUNCH_CHAOS in the environment): injected sleep:rank=0,at=600s" in launch.stderr
    from launcher.cli.status import _table, run_status

    table = "\n".join(_table(run_status(launch.run_url())))
    assert "chaos        sleep:rank=0,at=600s" in table
    assert launch.survivors() == []


def test_a_fault_at_a_commit_of_a_script_that_never_commits_says_it_never_landed(launcher, tmp_path):
    script = [BEATER, "--steps", "10", "--step-time", "0.02"]  # beats, never saves
    launch = launcher.run("--nproc", "1", "--chaos", "kill:rank=0,at=commit", *script, timeout=120)
    assert launch.proc.returncode == 0, launch.stderr
    assert "chaos: kill:rank=0,at=commit" in launch.stderr and "never landed" in launch.stderr
    assert launch.survivors() == []


def test_a_request_for_the_training_thread_is_never_carried_out_by_a_save(tmp_path):
    """Found by the matrix: a sleep requested for the next beat was picked up by the background
    save thread at its save point; the save thread slept, the next save waited for it with the
    heartbeat paused, and the hang was never declared. A request for a beat waits for the beat."""
    import os
    import subprocess
    import sys

    probe = (
        "from worker_lib.core import contract as c, progress\n"
        "progress.heartbeat(1)\n"
        "progress._slot[c.SLOT_CHAOS] = (1 << 16) | (c.CHAOS_AT_BEAT << 8) | c.CHAOS_RAISE\n"
        "assert progress.chaos_request(c.CHAOS_AT_SAVE) is None\n"
        "assert progress.chaos_request(c.CHAOS_AT_COMMIT) is None\n"
        "try:\n"
        "    progress.heartbeat(2)\n"
        "except RuntimeError as err:\n"
        "    print('raised at the beat:', err)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTLAUNCH_")}
    env[contract.FT_CHAOS] = "1"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "raised at the beat: injected by ftlaunch --chaos" in done.stdout
