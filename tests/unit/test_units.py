"""Pure logic with scripted inputs: policy, state table, plan, failure records, config."""

import io
import json
import os
import re
import signal
from pathlib import Path

import pytest
from helpers import dead_pid

from launcher.agent.parts import worker_plan
from launcher.cli.discover import resolve_backend
from launcher.core.config import EntryKind, LaunchConfig
from launcher.core.failures import ErrorRecord, ProcessFailure, describe_exit, read_error_file, root_cause
from launcher.core.group_state import ALLOWED_TRANSITIONS, GroupState, GroupStateMachine, IllegalTransition
from launcher.grammar.errors import UsageError
from launcher.process.logs import _Stream
from launcher.process.plan import plan_workers
from worker_lib.core import contract
from worker_lib.core.backend import choose_backend


def test_state_machine_follows_the_table_and_reports_every_transition():
    seen = []
    machine = GroupStateMachine(4, lambda **e: seen.append((e["old"], e["new"])))
    for state in (GroupState.RUNNING, GroupState.FAILED, GroupState.STOPPING, GroupState.STOPPED):
        machine.transition(state)
    assert seen == [
        (None, GroupState.STARTING),
        (GroupState.STARTING, GroupState.RUNNING),
        (GroupState.RUNNING, GroupState.FAILED),
        (GroupState.FAILED, GroupState.STOPPING),
        (GroupState.STOPPING, GroupState.STOPPED),
    ]
    with pytest.raises(IllegalTransition):
        machine.transition(GroupState.RUNNING)
    assert all(not ALLOWED_TRANSITIONS[s] for s in GroupState if s.is_terminal())


def test_plan_gives_each_rank_torchrun_variables(tmp_path):
    config = LaunchConfig.of(
        entrypoint="train.py",
        script_args=("--lr", "1"),
        nproc=2,
        max_failures=5,
        log_dir=tmp_path,
        run_id="r1",
        python="/py",
    )
    specs = plan_workers(worker_plan(config), attempt=3, master_port=1234, base_env={"PATH": "/bin"})
    assert [s.rank for s in specs] == [0, 1]
    assert specs[1].argv == ("/py", "-u", "train.py", "--lr", "1")
    env = specs[1].env
    assert env["PATH"] == "/bin"
    assert (env[contract.RANK], env[contract.WORLD_SIZE], env[contract.LOCAL_WORLD_SIZE]) == ("1", "2", "2")
    assert (env[contract.MASTER_PORT], env[contract.RESTART_COUNT], env[contract.MAX_RESTARTS]) == (
        "1234",
        "3",
        "5",
    )
    assert env[contract.USE_AGENT_STORE] == "True" and env["OMP_NUM_THREADS"] == "1"
    assert specs[1].log_file == tmp_path / "attempt_3" / "rank_1.log"
    assert env[contract.ERROR_FILE] == str((tmp_path / "attempt_3" / "rank_1.error.json").resolve())


def test_plan_keeps_the_users_thread_count(tmp_path):
    config = LaunchConfig.of(
        entrypoint="m", entry_kind=EntryKind.MODULE, nproc=2, log_dir=tmp_path, python="/py"
    )
    spec = plan_workers(worker_plan(config), 0, 1, base_env={"OMP_NUM_THREADS": "4"})[0]
    assert spec.env["OMP_NUM_THREADS"] == "4" and spec.argv == ("/py", "-u", "-m", "m")


def test_backend_choice():
    assert choose_backend("auto", 0) == "gloo" and choose_backend("auto", 8) == "nccl"
    assert choose_backend("gloo", 8) == "gloo"
    assert resolve_backend("nccl", 8, 8) == "nccl"
    with pytest.raises(UsageError, match="needs 9 GPUs, this node sees 8"):
        resolve_backend("nccl", 9, 8)


def test_config_is_frozen():
    config = LaunchConfig.of(entrypoint="x.py")
    with pytest.raises(AttributeError):
        config.group.nproc = 3


def test_exit_descriptions():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGSEGV) == "Signal 11 (SIGSEGV)"


def test_root_cause_is_the_earliest_failure():
    late = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=1, observed_at=2.0)
    early = ProcessFailure(rank=3, local_rank=3, pid=2, exitcode=-9, observed_at=1.0)
    assert root_cause([late, early]) is early
    same_poll = [
        ProcessFailure(0, 0, 1, 1, 5.0, ErrorRecord("B", timestamp=20)),
        ProcessFailure(1, 1, 2, 1, 5.0, ErrorRecord("A", timestamp=10)),
    ]
    assert root_cause(same_poll).rank == 1


def test_a_rank_killed_by_a_signal_is_the_cause_over_a_peer_that_exited_first():
    # Node 0 saw its rank's exit (gloo: "connection closed by peer") before node 1 saw the kill
    # that caused it: which supervisor looks first is a race, the kind of death is evidence.
    peer = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=1, observed_at=1.0, node=0)
    killed = ProcessFailure(rank=1, local_rank=0, pid=2, exitcode=-signal.SIGKILL, observed_at=1.2, node=1)
    assert root_cause([peer, killed]) is killed
    # NCCL's watchdog aborts the peers of a rank that raised: SIGABRT is no evidence of a cause.
    aborted = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=-signal.SIGABRT, observed_at=1.3)
    raised = ProcessFailure(rank=1, local_rank=1, pid=2, exitcode=1, observed_at=1.0)
    assert root_cause([aborted, raised]) is raised


def test_error_file_formats(tmp_path: Path):
    path = tmp_path / "e.json"
    path.write_text(
        json.dumps(
            {"message": {"message": "KeyError: 'x'", "extraInfo": {"py_callstack": "tb", "timestamp": "7"}}}
        )
    )
    assert read_error_file(path) == ErrorRecord("KeyError: 'x'", "tb", 7)
    path.write_text(json.dumps({"message": "plain", "timestamp": 3}))
    assert read_error_file(path) == ErrorRecord("plain", "", 3)
    path.write_text("{not json")
    assert read_error_file(path) is None
    assert read_error_file(tmp_path / "missing.json") is None


def test_console_buffer_stays_small_for_output_without_newlines():
    """A worker's 8 MB of progress bar, as the pipe delivers it: the unfinished console line is
    bounded (no quadratic re-splitting, no memory growth); the log gets every byte."""
    console, log = io.BytesIO(), io.BytesIO()
    stream = _Stream(0, log, console, b"[3] ")
    data = b"".join(b"\r step %07d" % i for i in range(8 * 2**20 // 14)) + b"x" * 10_000 + b"\nend"
    for start in range(0, len(data), 65536):
        stream.take(data[start : start + 65536])
        assert len(stream.partial) <= 4096
    stream.finish()
    assert log.getvalue() == data
    pieces = re.split(rb"[\r\n]+", console.getvalue())
    assert all(p.startswith(b"[3] ") for p in pieces if p)
    assert console.getvalue().count(b"[3]  step ") == data.count(b"\r step ")


def test_the_orphan_guard_leaves_a_group_number_that_passed_to_a_stranger():
    from launcher.orphan_guard.guard import _reused, _started

    assert not _reused("100", "100")  # the listed leader, alive: its group is killed
    assert not _reused("100", None) and not _reused(None, None)  # leader gone: its members may not be
    assert _reused("100", "200") and _reused(None, "200")  # the number is a new process's
    assert _started(os.getpid()) == _started(os.getpid()) is not None
    assert _started(dead_pid()) is None


@pytest.mark.parametrize(
    "url, modules",
    [
        ("gs://bucket/run", ["gcsfs"]),
        ("gcs://bucket/run", ["gcsfs"]),
        ("s3://bucket/run", ["s3fs"]),
        ("/data/ckpt", ["fsspec.implementations.local"]),
        ("simplecache::gcs://bucket/run", ["fsspec.implementations.cached", "gcsfs"]),
        ("no-such-protocol://x", []),  # the worker's own Storage says what is wrong with it
    ],
)
def test_the_fork_server_warms_the_filesystem_of_the_checkpoint_url(url, modules):
    from launcher.process.forkserver import storage_modules

    assert storage_modules(url) == modules


def test_an_elastic_attempt_numbers_its_ranks_densely_over_the_nodes_present(tmp_path):
    """Issue 25.2: node 2 of a --nnodes 2:3 job with node 1 gone runs ranks 2 and 3 of 4, as
    torchrun's group rank 1 of 2."""
    from launcher.core.layout import Layout

    config = LaunchConfig.of(
        entrypoint="train.py",
        nproc=2,
        nnodes=3,
        min_nodes=2,
        node_rank=2,
        rdzv_endpoint="h:1",
        log_dir=tmp_path,
    )
    specs = plan_workers(worker_plan(config), 4, 1, base_env={}, layout=Layout((0, 2), 2, 2))
    assert [s.rank for s in specs] == [2, 3] and specs[1].log_file.name == "rank_3.log"
    env = specs[1].env
    assert (env[contract.RANK], env[contract.WORLD_SIZE], env[contract.LOCAL_RANK]) == ("3", "4", "1")
    assert (env[contract.GROUP_RANK], env[contract.GROUP_WORLD_SIZE], env[contract.ROLE_WORLD_SIZE]) == (
        "1",
        "2",
        "4",
    )
    full = plan_workers(worker_plan(config), 4, 1, base_env={})  # every node present: the job's own numbering
    assert [s.rank for s in full] == [4, 5] and full[0].env[contract.WORLD_SIZE] == "6"
    with pytest.raises(ValueError, match="node 1 is not one of the attempt's nodes"):
        Layout((0, 2), 1, 2)


def test_a_store_left_to_the_supervisor_is_served_unless_a_signal_came_first():
    """A signal while the fork server starts: the attempt will not start, and serving its store
    here would first import torch, seconds before the signal is answered: nobody serves it."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from launcher.process.attempt_store import AttemptStore, host_here, unless_stopping

    served = AttemptStore("127.0.0.1", 0, unless_stopping(host_here, lambda: False))
    try:
        client = TCPStore("127.0.0.1", served.port, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        served.close()
    unserved = AttemptStore("127.0.0.1", 0, unless_stopping(host_here, lambda: True))
    try:
        with pytest.raises(ConnectionRefusedError):  # its socket closed: nothing listens
            socket.create_connection(("127.0.0.1", unserved.port), timeout=30).close()
    finally:
        unserved.close()


def test_a_storage_librarys_repeated_warning_is_said_once_and_its_errors_always():
    import logging

    from worker_lib.core.storage import _OncePerProcess

    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("gcsfs", level, __file__, 1, message, None, None)

    once = _OncePerProcess()
    assert once.filter(record(logging.WARNING, "falling back"))
    assert not once.filter(record(logging.WARNING, "falling back"))
    assert once.filter(record(logging.WARNING, "another warning"))
    assert all(once.filter(record(logging.ERROR, "failed")) for _ in range(2))
    assert all(once.filter(record(logging.DEBUG, "retrying")) for _ in range(2))
