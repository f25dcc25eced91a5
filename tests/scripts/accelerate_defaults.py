"""Accelerate left to its defaults under ftlaunch: on a node without a GPU it makes no process
group, so each rank would train alone, as rank 0. The adapter's load_state stops it."""

from accelerate import Accelerator

import worker_lib
from worker_lib.integrations import accelerate as fault_tolerance

accelerator = Accelerator()  # no cpu=True
print(f"Accelerate counts {accelerator.num_processes} process(es)", flush=True)
fault_tolerance.load_state(accelerator)
worker_lib.shutdown()
