"""The reliability matrix's short version (`make chaos` runs the long one, 10 trials): each fault once,
injected into examples/train.py at moments drawn from a seed that a failure names, each run
compared bit for bit with a fault-free one; no process may be left, no committed checkpoint lost.

Every fault runs in the first setup (train.py saving its state on local disk, where a full disk
is a tmpfs of its own); the GCS emulator's outage and its death under the run dir run with
checkpoints on it. The other setups
run the faults whose handling depends on how and where a checkpoint is written: a relaunch that
must find the run's checkpoints on GCS, a kill in a save and a torn file in directory mode, a kill
before the commit on GCS in directory mode. `make chaos` runs every fault in every setup.
"""

import os
import random
import sys
from contextlib import ExitStack

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import chaos_matrix as matrix  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# CHAOS_SEED=<the seed a failure names> replays its draws.
SEED = int(os.environ.get("CHAOS_SEED") or random.randrange(2**31))
EPOCHS = 4
TRIALS = 1  # the repetitions are make chaos's
FIRST = matrix.SETUPS["state-local"]
CASES = [(FIRST.id, fault) for fault, f in matrix.FAULTS.items() if f.fits(FIRST)] + [
    ("state-gcs", "outage"),
    ("state-gcs", "rundir-death"),
    ("state-gcs", "supervisor"),
    ("files-local", "save"),
    ("files-local", "torn"),
    ("files-gcs", "commit"),
]


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    """One Matrix per setup, entered when its first case runs (its storage, its fault-free run)."""
    work = tmp_path_factory.mktemp("chaos")
    entered = {}
    with ExitStack() as stack:

        def get(setup: str) -> matrix.Matrix:
            if setup not in entered:
                entered[setup] = stack.enter_context(matrix.Matrix(matrix.SETUPS[setup], EPOCHS, work))
            return entered[setup]

        yield get


# A setup's cases run on one test worker: its fault-free run (and storage) is made once, not once
# on each worker that draws one of its cases (8-10 s of CPU each).
@pytest.mark.parametrize(
    "setup, fault",
    [pytest.param(s, f, id=f"{s}:{f}", marks=pytest.mark.xdist_group(f"chaos-matrix-{s}")) for s, f in CASES],
)
def test_the_fault_is_survived_with_nothing_lost_or_left(setup, fault, matrices):
    if matrix.FAULTS[fault].needs == "tmpfs" and os.geteuid() != 0:
        pytest.skip("a full disk is a tmpfs of its own: mounting one needs root (CI and dev machines are)")
    trials = matrices(setup).run_fault(fault, TRIALS, SEED)
    assert matrix.passed(trials), f"seed {SEED} (CHAOS_SEED={SEED} replays it): " + "; ".join(
        map(str, trials)
    )
