"""What the adapter tests read from the framework examples' console (rank 0's lines): on CPUs in
tests/test_integrations.py, on a GPU in tests/gpu/test_adapters.py."""

import re

from helpers import ROOT

__all__ = ["EXAMPLES", "starts", "final_step", "device_of_starts"]

EXAMPLES = ROOT / "examples"
_START = re.compile(r"attempt (\d+) (?:starts at step (\d+)|resumes from (\S+)) on (\S+)")


def starts(stdout: str) -> list:
    """The step each attempt started from, as the example printed it."""
    return [int(step) if step else _step_of(folder) for _, step, folder, _ in _START.findall(stdout)]


def device_of_starts(stdout: str) -> list:
    """The device each attempt trained on, as the framework placed it."""
    return [device for *_, device in _START.findall(stdout)]


def final_step(stdout: str) -> int:
    return int(re.search(r"final: step (\d+)", stdout).group(1))


def _step_of(folder: str) -> int:
    return 0 if folder == "None" else int(re.search(r"step_0*(\d+)", folder).group(1))
