"""The built-in GPU check on a GPU machine: the probe answers for the ranks' GPU in a process of its
own (an allocation and a copy; NVML's memory questions where nvidia-ml-py is installed), and a
launch on nccl records the GPU as passed before its first attempt, CUDA never in the supervisor."""

import json
import os
import subprocess
import sys

from helpers import ACTOR, ROOT

from launcher.core.events import HealthChecked
from launcher.forked.gpu_probe import GPU_PROBE_MODULE, MARK


def _probe(env: dict) -> list:
    done = subprocess.run(
        [sys.executable, "-m", GPU_PROBE_MODULE],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [json.loads(line[len(MARK) :]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    return [done.returncode, said]


def test_the_probe_answers_for_each_gpu_it_is_given():
    code, said = _probe({"CUDA_VISIBLE_DEVICES": "0"})
    assert code == 0, said
    assert said[0] == {"name": "gpu 0", "status": "passed", "detail": "a small allocation and copy"}
    assert said[1]["name"] == "gpu 0 memory" and said[1]["status"] in ("passed", "unknown"), said


def test_the_probe_with_no_gpu_given_says_unknown():
    code, said = _probe({"CUDA_VISIBLE_DEVICES": ""})
    assert (code, [s["status"] for s in said]) == (0, ["unknown"])


def test_a_launch_on_nccl_checks_its_ranks_gpu_before_the_first_attempt(launcher):
    launch = launcher.run("--nproc", "1", "--backend", "nccl", ACTOR, timeout=180)

    assert launch.proc.returncode == 0, launch.stderr
    checked = launch.events(HealthChecked)
    assert [(c.before, c.healthy) for c in checked] == [("start", True)]
    assert "gpu 0" in checked[0].passed, checked
