"""A library that touches CUDA when it is imported (as a framework may, to pick a device) on a GPU
node under ftlaunch: the worker still starts and trains on its GPU over NCCL, and ftlaunch says at
most once that its workers start as new processes, and why, when the fork server cannot carry
what the import did to CUDA."""

import os
import re

import pytest
from helpers import SCRIPTS


@pytest.mark.parametrize("how", ["query", "init"])
def test_a_worker_starts_on_its_gpu_when_a_library_touches_cuda_at_import(how, launcher):
    path = [str(SCRIPTS / "cuda_touch"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), "TOUCH_CUDA": how}
    job = str(SCRIPTS / "cuda_job.py")
    launch = launcher.run("--nproc", "1", "--max-failures", "0", job, env=env, timeout=180)
    assert launch.proc.returncode == 0, launch.stderr[-3000:]
    assert f"rank 0 on cuda:0 ({how} at import): all-reduce 1" in launch.stdout, launch.stdout[-3000:]
    assert "backend nccl" in launch.stderr
    off = re.findall(r"fork server off: (.*)", launch.stderr)
    assert off == [] or (len(off) == 1 and "CUDA" in off[0]), off
    assert launch.survivors() == []
