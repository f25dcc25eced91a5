"""The many-node reliability matrix's short version (`make chaos` runs the long one, 10 trials):
each fault once on 2 nodes, and a follower's supervisor killed on 3, at moments drawn from a seed
that a failure names; each run's final weights compared bit for bit with a fault-free run's,
every node's exit 0, no process left, every node answering SIGTERM if a trial did not end."""

import os
import random
import sys
from contextlib import ExitStack

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import chaos_nodes as matrix  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# CHAOS_SEED=<the seed a failure names> replays its draws.
SEED = int(os.environ.get("CHAOS_SEED") or random.randrange(2**31))
CASES = [(2, fault) for fault in matrix.FAULTS] + [(3, "follower-kill")]


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    """One Matrix per job size, entered when its first case runs (its fault-free run)."""
    work = tmp_path_factory.mktemp("chaos_nodes")
    entered = {}
    with ExitStack() as stack:

        def get(nnodes: int) -> matrix.Matrix:
            if nnodes not in entered:
                entered[nnodes] = stack.enter_context(matrix.Matrix(nnodes, work))
            return entered[nnodes]

        yield get


# A job size's cases run on one test worker: its fault-free run is made once, not once on each
# worker that draws one of its cases (a launch of every node).
@pytest.mark.parametrize(
    "nnodes, fault",
    [
        pytest.param(n, f, id=f"{n}-nodes:{f}", marks=pytest.mark.xdist_group(f"chaos-nodes-{n}"))
        for n, f in CASES
    ],
)
def test_a_node_fault_is_survived_with_nothing_lost_or_left(nnodes, fault, matrices):
    trials = matrices(nnodes).run_fault(fault, 1, SEED)
    assert matrix.passed(trials), f"seed {SEED} (CHAOS_SEED={SEED} replays it): " + "; ".join(
        map(str, trials)
    )
