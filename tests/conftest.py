"""The ``launcher`` fixture: runs ftlaunch, then fails the test if anything it started survives."""

from pathlib import Path

import pytest
from helpers import Launcher


@pytest.fixture
def launcher(tmp_path: Path):
    """Runs ftlaunch; after the test, fails it if any process it started is still alive."""
    runner = Launcher(tmp_path)
    yield runner
    leaked = runner.cleanup()
    assert not leaked, f"processes survived the test: {leaked}"
