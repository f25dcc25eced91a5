"""The many-node matrix's verdict on a trial's final weights, without processes: bit for bit, and
a difference said with its size and where the attempts started (a reader judges from that)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import chaos_nodes  # noqa: E402

EXPECTED = {"weight": torch.tensor([[5.8e-4, -2.0e-6]]), "bias": torch.tensor([-8.1e-5])}


def _one_bit_away(value: torch.Tensor) -> torch.Tensor:
    return (value.view(torch.int32) ^ 1).view(torch.float32)


def test_one_bit_of_difference_is_not_identical_and_is_said_with_the_resume_steps(tmp_path):
    job = chaos_nodes.NodeJob(tmp_path / "trial", 3)
    (job.work / "node0_1.log").write_text("[0] rank 0 attempt 0 starts at step 0\n")
    (job.work / "node0_4.log").write_text("[0] rank 0 attempt 1 starts at step 160\n")
    got = {**EXPECTED, "bias": _one_bit_away(EXPECTED["bias"])}
    assert chaos_nodes.same_weights(dict(EXPECTED), EXPECTED)
    assert not chaos_nodes.same_weights(got, EXPECTED)
    note = chaos_nodes._unlike(job, got, EXPECTED)
    assert note == "the final weights differ by up to 7.3e-12; attempts started at steps [0, 160]", note


def test_other_tensors_are_said_as_such(tmp_path):
    job = chaos_nodes.NodeJob(tmp_path / "trial", 3)
    got = {"weight": torch.zeros(1, 3), "bias": EXPECTED["bias"]}
    assert not chaos_nodes.same_weights(got, EXPECTED)
    assert chaos_nodes._unlike(job, got, EXPECTED) == "the final weights are not the fault-free run's tensors"
