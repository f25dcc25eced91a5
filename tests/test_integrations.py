"""The framework adapters, each with its real framework on 2 ranks of DDP over gloo, run through
the examples: a kill in the middle of a save and a hang (SIGSTOP) of a rank are survived, and the
next attempt starts from the newest step every rank committed; a preemption (SIGTERM) stops every
rank at one agreed step, saved on the GCS emulator, and the relaunch goes on from it, no step
lost. Where the framework's resume is exact, the weights equal an uninterrupted run's."""

import os
import re
import signal
import time

import fsspec
import pytest
import torch
from adapter_runs import EXAMPLES, device_of_starts, final_step, starts
from conftest import use_emulator
from helpers import SCRIPTS

# Each test starts a framework 3-5 times on 2 ranks (Lightning's import alone is seconds of CPU):
# on a loaded 2-core machine, past the suite's 120 s.
pytestmark = pytest.mark.timeout(600)

# (example, its arguments: 40 optimizer steps in all, a save every 10, and the final step count)
JOBS = {
    "lightning": ("lightning_train.py", ["--epochs", "2", "--save-every", "10"], 40),
    "transformers": ("transformers_train.py", ["--max-steps", "40", "--save-steps", "10"], 40),
    "accelerate": ("accelerate_train.py", ["--epochs", "2", "--save-every", "10"], 40),
}
# Every resume here is exact, and the weights are compared with an uninterrupted run's: the Trainer
# restores each rank's RNG streams and skips the batches seen; the Accelerate example shuffles by
# epoch and skips them itself; Lightning resumes exactly from a step at an epoch's end (20 is one:
# 1280 samples, 2 ranks, 32 a batch), not from the middle of one (the adapter's docs say why).
EXACT = {"lightning", "transformers", "accelerate"}
# Lightning's job gets the SLURM notice (which ftlaunch takes for SIGTERM), the others SIGTERM.
PREEMPT = {"lightning": signal.SIGUSR1, "transformers": signal.SIGTERM, "accelerate": signal.SIGTERM}


def _command(framework, *extra):
    script, args, _ = JOBS[framework]
    return ["--nproc", "2", "--run-name", framework, *extra, str(EXAMPLES / script), *args]


@pytest.mark.parametrize("framework", sorted(JOBS))
def test_a_torn_save_and_a_hang_are_survived_from_the_newest_committed_step(framework, launcher, tmp_path):
    """The first save is killed half-way (a rank's part torn): the next attempt starts afresh, not
    from it. Then a rank stops (SIGSTOP) at step 23 (ftlaunch sees the step within a poll; 0.1 s
    steps leave it 0.7 s before step 30 is saved): the missing beats are a hang, and the group
    restarts from step 20, the newest committed."""
    chaos = "kill:at=save;hang:at=step:23;seed=3"
    faulty = launcher.run(
        *_command(framework, "--chaos", chaos, "--heartbeat-timeout", "4s", "--max-failures", "3"),
        "--out",
        str(tmp_path / "faulty.pt"),
        "--step-time",
        "0.1",
        timeout=240,
    )
    assert faulty.proc.returncode == 0, faulty.stderr[-3000:]
    assert starts(faulty.stdout) == [0, 0, 20], faulty.stdout[-3000:]
    placed = [device.split(":")[0] for device in device_of_starts(faulty.stdout)]  # Accelerate: cpu:0
    assert placed == ["cpu"] * 3  # where ftlaunch put the ranks: gloo here
    assert "backend gloo" in faulty.stderr
    assert "hung" in faulty.stderr, faulty.stderr[-3000:]
    assert final_step(faulty.stdout) == JOBS[framework][2]
    if framework in EXACT:
        clean = launcher.run(
            *_command(framework, "--run-name", f"{framework}-clean"),
            "--out",
            str(tmp_path / "clean.pt"),
            timeout=180,
        )
        assert clean.proc.returncode == 0, clean.stderr[-3000:]
        faulty_weights, clean_weights = torch.load(tmp_path / "faulty.pt"), torch.load(tmp_path / "clean.pt")
        assert faulty_weights.keys() == clean_weights.keys()
        for name, value in clean_weights.items():
            assert torch.equal(faulty_weights[name], value), name
    assert faulty.survivors() == []


@pytest.mark.parametrize("framework", sorted(JOBS))
def test_a_preemption_saves_one_agreed_step_on_gcs_and_the_relaunch_goes_on_from_it(
    framework, launcher, tmp_path, gcs_env, monkeypatch
):
    use_emulator("gcs", gcs_env, monkeypatch)
    bucket = f"integrations-{framework}"
    fsspec.filesystem("gcs").mkdir(bucket)
    command = _command(framework, "--checkpoint-dir", f"gcs://{bucket}/run", "--grace-period", "60")
    first = launcher.start(*command, "--step-time", "0.1", env=gcs_env)
    first.read_console_until(lambda line: "attempt 0 " in line, timeout=120)
    _wait_for_commit(f"{bucket}/run", first)
    first.proc.send_signal(PREEMPT[framework])
    assert first.wait(120) == 143, first.stderr[-3000:]
    asked = re.search(r"asking the workers to save and stop at step (\d+)", first.stderr)
    assert asked, first.stderr[-3000:]
    stop = int(asked.group(1))
    assert fsspec.filesystem("gcs").exists(f"{bucket}/run/step_{stop}/COMMITTED")

    second = launcher.run(*command, env=gcs_env, timeout=180)
    assert second.proc.returncode == 0, second.stderr[-3000:]
    assert starts(second.stdout) == [stop], second.stdout[-3000:]  # no step lost, none done twice
    assert final_step(second.stdout) == JOBS[framework][2]
    assert first.survivors() == [] and second.survivors() == []


def _wait_for_commit(path: str, launch, timeout: float = 120) -> None:
    """Bounded wait until a step is committed under ``path``."""
    fs = fsspec.filesystem("gcs")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fs.invalidate_cache()
        if fs.glob(f"{path}/step_*/COMMITTED"):
            return
        assert launch.proc.poll() is None, launch.stderr
        time.sleep(0.2)
    raise AssertionError(f"no committed step under gcs://{path} after {timeout}s")


def test_a_library_that_asks_about_cuda_at_import_still_gets_forked_workers(launcher):
    """Frameworks ask torch about CUDA when imported (is_available, device_count) to pick a device.
    On a node without a GPU that initializes nothing a fork cannot carry: the fork server imports
    such a library (from PYTHONPATH, as an installed one) and forks the workers, which train on
    gloo; ftlaunch would say "fork server off" once otherwise. tests/gpu has the GPU's side."""
    path = [str(SCRIPTS / "cuda_touch"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), "TOUCH_CUDA": "query"}
    launch = launcher.run("--nproc", "2", str(SCRIPTS / "cuda_job.py"), env=env, timeout=120)
    assert launch.proc.returncode == 0, launch.stderr[-3000:]
    assert "fork server off" not in launch.stderr, launch.stderr[-3000:]
    found = re.findall(r"rank (\d) on (\S+) \(query at import\): all-reduce (\d+)", launch.stdout)
    assert sorted(found) == [("0", "cpu", "3"), ("1", "cpu", "3")], launch.stdout[-3000:]
    assert launch.survivors() == []


def test_accelerate_left_to_its_defaults_on_a_cpu_node_is_stopped_before_ranks_train_alone(launcher):
    """Without cpu=True, Accelerate on a node without a GPU makes no process group: every rank
    would train alone and save as rank 0. The adapter says so on every rank, with the fix."""
    launch = launcher.run(
        "--nproc", "2", "--max-failures", "0", str(SCRIPTS / "accelerate_defaults.py"), timeout=120
    )  # fmt: skip
    assert launch.proc.returncode == 1, launch.stderr[-3000:]
    assert launch.stdout.count("Accelerate counts 1 process(es)") == 2, launch.stdout[-3000:]
    said = "Accelerate counts 1 rank(s) where ftlaunch started 2, so each would train alone"
    assert said in launch.stderr and "Accelerator(cpu=" in launch.stderr, launch.stderr[-3000:]
    assert launch.survivors() == []
