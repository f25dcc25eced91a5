"""Tests that need a CUDA GPU. Where none is visible they are skipped with that reason, never
faked: run them on a GPU machine (`python -m pytest tests/gpu`, see DEVELOPERS.md)."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items) -> None:
    if _cuda_visible():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU is visible: tests/gpu runs on a GPU machine")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
