"""What the supervisor and the fork server's processes share: the names they run by and are found
by, defined once (a copy left behind by a move would find nothing, and a chaos trial would kill
nothing: ``tests/unit/test_process_names.py``), the zygote's environment, the jobs that are not a
rank's worker.
"""

import os
from typing import Optional

__all__ = [
    "SINGLE_THREADED",
    "SPARE_TITLE",
    "STORE_HOST_TITLE",
    "ZYGOTE_MODULE",
    "spare_job",
    "store_job",
]

ZYGOTE_MODULE = "launcher.forked.zygote"  # the fork server runs as ``python -m`` this
SPARE_TITLE = "ftlaunch-spare"  # what ps shows of a parked spare: then its local rank and state
STORE_HOST_TITLE = "ftlaunch-store"  # what ps shows of the store host
# In the zygote only: libraries that start their thread pool at import would leave threads behind.
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def spare_job(local_rank: int, cuda: bool, slots: Optional[dict]) -> dict:
    return {
        "argv": [SPARE_TITLE, str(local_rank)],  # what ps shows
        # the rank's env and cwd come with its request
        "spare": {"local_rank": local_rank, "cuda": cuda, "slots": slots},
    }


def store_job() -> dict:
    return {"argv": [STORE_HOST_TITLE], "env": dict(os.environ), "cwd": os.getcwd(), "store": True}
