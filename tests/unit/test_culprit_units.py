"""A hang's culprit from every rank's last collective, and the root cause that agrees with it."""

from launcher.core.beats import Entered, Phase
from launcher.core.failures import HangFailure, root_cause
from launcher.hangs.culprit import hang_culprit
from worker_lib.core.own_work import last_collective


def test_the_rank_that_never_entered_the_collective_the_others_wait_in_is_named_with_its_node():
    entered = {
        0: Entered(57, "all_reduce", 0),
        1: Entered(57, "all_reduce", 0),
        2: Entered(57, "all_reduce", 1),
        3: Entered(56, "all_reduce", 1),
    }
    assert hang_culprit(entered) == (
        "rank 3 (node 1) never entered all_reduce #57 (its last: all_reduce #56), which ranks 0 (node 0), "
        "1 (node 0) and 2 (node 1) entered and wait in: they wait, they are not hung of their own"
    )


def test_a_rank_in_another_collective_at_the_same_number_is_named():
    entered = {0: Entered(9, "all_reduce"), 1: Entered(9, "broadcast"), 2: Entered(9, "all_reduce")}
    assert hang_culprit(entered).startswith(
        "rank 1 entered broadcast as #9, not all_reduce, which ranks 0 and 2"
    )


def test_no_culprit_when_every_rank_waits_in_the_same_one_or_too_little_is_known():
    assert hang_culprit({0: Entered(9, "all_reduce"), 1: Entered(9, "all_reduce")}) == ""
    assert hang_culprit({0: Entered(9, "all_reduce")}) == ""
    assert hang_culprit({0: Entered(0, "other"), 1: Entered(0, "other")}) == ""
    assert "it entered none" in hang_culprit({0: Entered(3, "barrier"), 1: Entered(0, "other")})


def _hung(rank, collective, stack=()):
    return HangFailure(
        rank, rank, 100 + rank, Phase.STEPPING, 6.0, 5.0, 40, 1.0, stack=stack, collective=collective
    )


def test_the_root_cause_of_a_hang_is_the_rank_behind_in_the_collectives_when_all_are_known():
    waiting = ("File torch/_tensor.py, line 600 in backward",)  # DDP's wait: no torch/distributed frame
    failures = [_hung(0, 57, waiting), _hung(1, 56), _hung(2, 57, waiting)]
    assert root_cause(failures).rank == 1
    # one unknown: the collectives are not compared; the stacks and steps decide as before
    unknown = [_hung(0, 57), _hung(1, -1), _hung(2, 56)]
    assert root_cause(unknown).rank == 0


def test_the_last_collective_is_read_from_the_default_groups_entries():
    entries = [
        {"pg_id": 0, "collective_seq_id": 4, "profiling_name": "gloo:all_reduce", "is_p2p": False},
        {"pg_id": 0, "collective_seq_id": 5, "profiling_name": "gloo:broadcast", "is_p2p": False},
        {"pg_id": 1, "collective_seq_id": 9, "profiling_name": "gloo:all_reduce", "is_p2p": False},
    ]
    assert last_collective(entries) == (5, 2)  # broadcast, index 2 of COLLECTIVE_KINDS
    assert last_collective([]) == (0, 0)
