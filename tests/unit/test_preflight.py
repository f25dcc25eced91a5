"""Preflight's checks that need no process and no storage server."""

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from launcher.cli.preflight import _check_outside_this_process
from launcher.grammar.errors import UsageError


class _Scratch(MemoryFileSystem):
    """A memory filesystem a user registered under a name of their own."""

    protocol = "ftlaunch-test-scratch"


@pytest.mark.parametrize(
    "url", ["memory://x", "memory:///x", "simplecache::memory://x", "ftlaunch-test-scratch://x"]
)
def test_storage_inside_one_process_is_known_by_its_fsspec_class_not_its_name(url):
    """Issue 48.5: each worker opened its own memory filesystem; nothing saved was ever loaded."""
    fsspec.register_implementation("ftlaunch-test-scratch", _Scratch, clobber=True)
    with pytest.raises(UsageError, match="fsspec keeps it inside the process that opens it"):
        _check_outside_this_process("checkpoint storage (--checkpoint-dir)", url, "why")


@pytest.mark.parametrize("url", ["/shared/ckpt", "file:///shared/ckpt", "gs://bucket/x", "s3://b/x"])
def test_storage_every_process_reaches_passes(url):
    _check_outside_this_process("checkpoint storage (--checkpoint-dir)", url, "why")
