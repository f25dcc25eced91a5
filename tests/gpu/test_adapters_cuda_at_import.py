"""A library that touches CUDA when it is imported (as a framework may, to pick a device) on a GPU
node under ftlaunch: the worker still starts and trains on its GPU over NCCL, and ftlaunch says at
most once that its workers start as new processes, and why, when the fork server cannot carry
what the import did to CUDA."""

import os
import re

import pytest
from helpers import SCRIPTS


@pytest.mark.parametrize("preloaded", [False, True], ids=["in-the-worker", "preloaded"])
@pytest.mark.parametrize("how", ["query", "init"])
def test_a_worker_starts_on_its_gpu_when_a_library_touches_cuda_at_import(how, preloaded, launcher):
    """Imported by the script, the library runs in each worker after the fork: nothing to carry.
    Preloaded (--preload), it runs in the fork server, which must see that it initialized CUDA or
    only its driver (is_available's cuInit) and turn itself off, saying so once."""
    path = [str(SCRIPTS / "cuda_touch"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), "TOUCH_CUDA": how}
    job = str(SCRIPTS / "cuda_job.py")
    preload = ["--preload", "touch_cuda"] if preloaded else []
    launch = launcher.run("--nproc", "1", "--max-failures", "0", *preload, job, env=env, timeout=180)
    assert launch.proc.returncode == 0, launch.stderr[-3000:]
    assert f"rank 0 on cuda:0 ({how} at import): all-reduce 1" in launch.stdout, launch.stdout[-3000:]
    assert "backend nccl" in launch.stderr
    off = re.findall(r"fork server off: (.*)", launch.stderr)
    if preloaded:
        assert len(off) == 1 and "CUDA" in off[0], off
    else:
        assert off == [], off
    assert launch.survivors() == []
