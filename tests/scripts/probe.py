"""A worker that writes down what it sees of itself, for the fork server's tests: how it was
started, its process relations, its streams and signals, its random streams.

    probe.py OUT_DIR [--leak] [--crash-rank R]

Writes OUT_DIR/rank_<r>.attempt_<a>.json. --leak sets a module attribute in attempt 0 that a
later attempt must not see; --crash-rank R: that rank exits 3 in attempt 0, after writing.
"""

import gc
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy
import torch

import worker_lib

RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def seen() -> dict:
    return {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "ppid": os.getppid(),
        "own_session": os.getsid(0) == os.getpid() and os.getpgid(0) == os.getpid(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "usr1": "ignored" if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else "not ignored",
        "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", str(signal.getsignal(signal.SIGINT))),
        "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through],
        "torch_threads": torch.get_num_threads(),
        "torch_seed": torch.initial_seed(),
        "numpy_draw": float(numpy.random.random()),
        "random_draw": random.random(),
        "leaked": hasattr(worker_lib, "_probe_leak"),
        "forked": gc.get_freeze_count() > 0,  # the fork server froze its objects
        "gc": [gc.isenabled(), gc.get_threshold()],  # the zygote imports with its collector off
        "storage_imported": [m for m in ("gcsfs", "s3fs") if m in sys.modules],  # none imports them
        "env_rank": os.environ["RANK"],
        "file": __file__,
        "loader": type(__loader__).__name__,
        "spec": repr(__spec__),
        # what ps and monitoring tools see of this process
        "cmdline": [a.decode() for a in open("/proc/self/cmdline", "rb").read().split(b"\0") if a],
        "environ_rank": f"RANK={RANK}".encode() in open("/proc/self/environ", "rb").read().split(b"\0"),
    }


def main() -> None:
    out = Path(sys.argv[1])
    crash_rank = int(sys.argv[sys.argv.index("--crash-rank") + 1]) if "--crash-rank" in sys.argv else None
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{RANK}.attempt_{ATTEMPT}.json").write_text(json.dumps(seen()))
    if "--leak" in sys.argv:  # were a later attempt forked from this process, it would see it
        worker_lib._probe_leak = True
    print(f"rank {RANK} probed", flush=True)
    if ATTEMPT == 0 and RANK == crash_rank:
        # Not before every rank wrote its probe: the crash stops the others (on a busy machine
        # rank 0 was stopped before it wrote, and its attempt-0 probe was missing).
        deadline = time.monotonic() + 60
        while not all((out / f"rank_{r}.attempt_0.json").exists() for r in range(WORLD_SIZE)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        sys.exit(3)


if __name__ == "__main__":
    main()
