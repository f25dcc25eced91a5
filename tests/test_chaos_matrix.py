"""The reliability matrix's short version (`make chaos` runs the long one): every fault, twice,
injected into examples/train.py at moments drawn from a seed that a failure names, each run
compared bit for bit with a fault-free one; no process may be left, no committed checkpoint lost."""

import random
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import chaos_matrix as matrix  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SEED = random.randrange(2**31)
EPOCHS = 4
TRIALS = 2


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos")


@pytest.fixture(scope="module")
def expected(work):
    return matrix.reference_state(work, EPOCHS)


@pytest.mark.parametrize("fault", list(matrix.FAULTS))
def test_the_fault_is_survived_with_nothing_lost_or_left(fault, work, expected):
    trials = matrix.run_fault(fault, TRIALS, SEED, EPOCHS, work, expected)
    assert matrix.passed(trials), f"seed {SEED}: " + "; ".join(map(str, trials))
