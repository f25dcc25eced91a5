"""Fixtures: ``launcher`` runs ftlaunch and fails the test if anything it started survives;
``storage`` is a fresh checkpoint location on a local disk, a GCS emulator or an S3 emulator."""

import os

# Before gcsfs is imported anywhere: otherwise every write waits 60 s on a gRPC call that the
# emulator never answers. Workers inherit it from here.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Dict  # noqa: E402

import pytest  # noqa: E402
from helpers import Launcher  # noqa: E402
from storage_servers import start_gcs, start_s3  # noqa: E402

_PR_GET_CHILD_SUBREAPER = 37


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return flag.value != 0


@pytest.fixture(autouse=True)
def _never_a_subreaper():
    """A launch run in the test's own process (``main()`` past the usage checks) makes it a child
    subreaper for the rest of the session: every orphan of a later test on that worker becomes
    its child (a stranger's process counted as ours failed test_stopping once)."""
    yield
    assert not _is_subreaper(), "the test ran a launch in the test process: it became a child subreaper"


@pytest.fixture
def launcher(tmp_path: Path, request):
    """Runs ftlaunch; after the test, fails it if any process it started is still alive. In a
    module marked ``exec_workers``, its launches start their workers as new processes."""
    plain = request.node.get_closest_marker("exec_workers") is not None
    runner = Launcher(tmp_path, spawner=("--no-fork-server",) if plain else ())
    yield runner
    leaked = runner.cleanup()
    assert not leaked, f"processes survived the test: {leaked}"


@dataclasses.dataclass(frozen=True)
class StorageTarget:
    kind: str
    url: str  # a fresh, empty location for this test
    env: Dict[str, str]  # FSSPEC_* settings (and credentials) that reach this storage


@pytest.fixture(scope="session")
def gcs_env(tmp_path_factory):
    server, env = start_gcs(tmp_path_factory.mktemp("gcs"))
    yield env
    server.stop()


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    server, env = start_s3(tmp_path_factory.mktemp("s3"))
    yield env
    server.stop()


@pytest.fixture(params=["local", "gcs", "s3"])
def storage(request, tmp_path, monkeypatch) -> StorageTarget:
    """The same test on each storage. In this process fsspec's config is set directly (it read
    the environment at import); processes started by the test get it through ``env``."""
    import fsspec

    if request.param == "local":
        return StorageTarget("local", str(tmp_path / "ckpt"), {})
    protocol = request.param
    env = request.getfixturevalue(f"{protocol}_env")
    use_emulator(protocol, env, monkeypatch)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem(protocol).mkdir(bucket)
    return StorageTarget(protocol, f"{protocol}://{bucket}/run", env)


def use_emulator(protocol: str, env: Dict[str, str], monkeypatch) -> None:
    """Point this process (fsspec's config) and its children (environment) at an emulator."""
    import fsspec

    prefix = f"FSSPEC_{protocol.upper()}_"
    options = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, protocol, options)


_GPU_TESTS = Path(__file__).resolve().parent / "gpu"


# The modules whose tests take longest (a make test on this 2-core machine, 2026-11-26: the chaos
# matrices 60-165 s a test, the frameworks 90-130 s, many nodes 40-85 s), slowest first. `make
# test` hands tests to its workers one at a time in collection order (--dist loadgroup), so these
# go first and the quick ones fill the end: a 2-minute test started last held the run's end alone.
_SLOWEST_FIRST = (
    "test_chaos_matrix.py",
    "test_chaos_nodes.py",
    "test_integrations.py",
    "test_many_nodes.py",
    "test_standby.py",
    "test_slurm.py",
    "test_meeting_faults.py",
    "test_node_faults.py",
    "test_chaos_node_faults.py",
    "test_elastic.py",
    "test_bench_standby.py",
    "test_checkpoint_e2e.py",
    "test_run_dir.py",
    "test_fork_server.py",
    "test_warm_spare.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Slowest modules first (above). tests/gpu needs a CUDA GPU: where none is visible its tests
    are skipped with that reason, never faked (run them on a GPU machine: DEVELOPERS.md). Here,
    not in a conftest.py of its own: two modules named conftest would take each other's place
    under pytest-xdist."""
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable
    gpu_tests = [item for item in items if _GPU_TESTS in Path(str(item.fspath)).resolve().parents]
    if not gpu_tests or _cuda_visible():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU is visible: tests/gpu runs on a GPU machine")
    for item in gpu_tests:
        item.add_marker(skip)


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()
