"""The command line: --help, FTLAUNCH_* variables, and every kind of bad input → one clear
line, exit code 2, no worker started. What only checks options runs ftlaunch's ``main()`` in this
process (``ftlaunch`` below); what needs a launch's own process (a limit set before it starts, a
signal, a server it talks to) starts one."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from helpers import ACTOR, MARKER, ROOT, processes_with_marker
from storage_servers import start_s3_read_only

from launcher.cli.main import main

# The options' rules hold however the workers start (the fork server's own are test_fork_server's).
pytestmark = pytest.mark.exec_workers


@dataclasses.dataclass(frozen=True)
class Ran:
    """``main()``'s exit code and what it wrote, as a launch's process would have."""

    returncode: int
    stdout: str
    stderr: str
    log_dir: Path
    left: list  # child processes it left behind (none may be)


@pytest.fixture
def ftlaunch(capsys, monkeypatch, tmp_path):
    """ftlaunch's ``main(argv)`` in this process, with its runs and logs in the test's folder and
    the repository as its working directory (as a launch's process has); ``env``: FTLAUNCH_*
    variables for this call."""

    def run(*args: str, env=None) -> Ran:
        monkeypatch.chdir(ROOT)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        logs = tmp_path / "logs"
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        code = main(["--log-dir", str(logs), "--run-dir", str(tmp_path / "runs"), *args])
        out = capsys.readouterr()
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        for name in env or {}:
            monkeypatch.delenv(name)
        return Ran(int(code), out.out, out.err, logs, left)

    return run


def _assert_usage_error(launch, fragment: str) -> None:
    """``launch``: a launch's process (waited for) or what ``main()`` did in this process."""
    code = launch.returncode if isinstance(launch, Ran) else launch.proc.returncode
    assert code == 2, launch.stderr
    lines = launch.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftlaunch: error: "), launch.stderr
    assert fragment in lines[0]
    assert not (launch.log_dir / "attempt_0").exists()  # no worker was started
    assert (launch.left if isinstance(launch, Ran) else launch.survivors()) == []


def test_help_lists_the_options(ftlaunch):
    launch = ftlaunch("--help")
    assert launch.returncode == 0
    for option in (
        "--nproc",
        "--nproc-per-node",
        "--module",
        "--no-python",
        "--max-failures",
        "--backend",
        "--log-dir",
        "--grace-period",
        "--console-ranks",
        "FTLAUNCH_",
    ):
        assert option in launch.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["missing_script.py"], "script not found: missing_script.py"),
        (["--nproc", "0", str(ACTOR)], "--nproc must be at least 1, got 0"),
        (["--nproc", "two", str(ACTOR)], "--nproc must be a whole number or 'auto'"),
        (
            ["--nproc", "100000", str(ACTOR)],
            "--nproc 100000 is more workers than this node can hold: at most",
        ),
        (["--backend", "mpi", str(ACTOR)], "'mpi' is not one of 'auto', 'nccl', 'gloo'"),
        (["--backend", "nccl", "--nproc", "1", str(ACTOR)], "with nccl needs 1 GPUs, this node sees 0"),
        (["--max-failures", "-2", str(ACTOR)], "--max-failures must be -1 (unlimited) or more"),
        (["--grace-period", "-1", str(ACTOR)], "--grace-period must be 0 or more seconds"),
        (["--nproc", "2", "--console-ranks", "0,5", str(ACTOR)], "--console-ranks names ranks [5]"),
        (["--module", "--no-python", "json.tool"], "--module and --no-python exclude each other"),
        (["--no-python", "no-such-program-here"], "executable not found"),
        (["--checkpoint-dir", "nosuchproto://bucket/run", str(ACTOR)], "Protocol not known: nosuchproto"),
        (["--frobnicate", str(ACTOR)], "No such option '--frobnicate'"),
        (["--heartbeat-timeout", "soon", str(ACTOR)], "--heartbeat-timeout takes a duration like 90, 90s"),
        (["--init-timeout", "0", str(ACTOR)], "--init-timeout and --heartbeat-floor must be more than 0"),
        (["--heartbeat-floor", "-5s", str(ACTOR)], "--heartbeat-floor must not be negative"),
        (["--heartbeat-timeout", "nan", str(ACTOR)], "--heartbeat-timeout takes a duration like"),
        (["--init-timeout", "inf", str(ACTOR)], "--init-timeout takes a duration like"),
        (["--grace-period", "nan", str(ACTOR)], "Invalid value for '--grace-period': 'nan' is not a number"),
        (["--grace-period", "inf", str(ACTOR)], "Invalid value for '--grace-period': 'inf' is not a number"),
        (["--max-backoff", "inf", str(ACTOR)], "--max-backoff takes a duration like"),
        (["--storage-timeout", "0", str(ACTOR)], "--storage-timeout must be more than 0 seconds"),
        (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
        (["-m", "no_such_package_here.train"], "module no_such_package_here.train: ModuleNotFoundError"),
        ([], "Missing argument 'SCRIPT'"),
        (
            ["--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)],
            "MIN must be at least 1 and at most MAX",
        ),
        (["--nnodes", "two:3", str(ACTOR)], "--nnodes takes N or MIN:MAX (whole numbers), got 'two:3'"),
        (
            ["--nnodes", "1:2", "--join-timeout", "5s", "--rdzv-conf", "last_call_timeout=9"]
            + ["--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)],
            "last_call_timeout=9 must be shorter than --join-timeout (5 s)",
        ),
        # Past about 24 days torch's store timeouts overflow (it was exit 70 with a traceback).
        (
            ["--nnodes", "2", "--node-timeout", "99999999999d", "--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)],
            "--node-timeout 8.64e+15 s: at most 7 days (604800 s)",
        ),
        (
            ["--nnodes", "2", "--join-timeout", "8d", "--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)],
            "at most 7 days",
        ),
        # Issue 33.3: nothing is sized by MAX before MAX nodes exist, and MAX is bounded.
        (
            ["--nnodes", "2:1000000000", "--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)],
            "--nnodes 2:1000000000: at most 16384 nodes",
        ),
        (
            ["--nnodes", "9999999999999999999", "--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)],
            "--nnodes 9999999999999999999: at most 16384 nodes",
        ),
        # torch takes them as C ints (a traceback past 2**31), and 0 keeps nodes from ever meeting.
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-endpoint",
                "127.0.0.1:1",
                "--rdzv-conf",
                "join_timeout=99999999999999999999",
            ]
            + [str(ACTOR)],
            "--rdzv-conf join_timeout=99999999999999999999: must be 1 to 604800 seconds (7 days)",
        ),
        (
            ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "keep_alive_max_attempt=0"]
            + [str(ACTOR)],
            "--rdzv-conf keep_alive_max_attempt=0: must be 1 to 604800",
        ),
        # The error names --nnodes as written: an elastic job's MIN too.
        (["--nnodes", "1:16384", str(ACTOR)], "--nnodes 1:16384 needs --rdzv-endpoint HOST:PORT"),
        # int() and float() take other scripts' digits and underscores; no shell script means them.
        (["--nproc", "\uff12", str(ACTOR)], "--nproc must be a whole number or 'auto'"),
        (
            ["--max-failures", "1_0", str(ACTOR)],
            "Invalid value for '--max-failures': '1_0' is not a whole number",
        ),
        (
            ["--grace-period", "\uff15", str(ACTOR)],
            "Invalid value for '--grace-period': '\uff15' is not a number",
        ),
        (["--nnodes", "\uff12", str(ACTOR)], "--nnodes takes N or MIN:MAX (whole numbers)"),
        (["--heartbeat-timeout", "\u0661\u0660", str(ACTOR)], "--heartbeat-timeout takes a duration like"),
        (
            ["--chaos", "kill:rank=\uff11,at=step:3", str(ACTOR)],
            "--chaos: rank takes a whole number, got '\uff11'",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:\uff12\uff19\uff15", str(ACTOR)],
            "needs --rdzv-endpoint HOST:PORT",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(ftlaunch, args, fragment):
    _assert_usage_error(ftlaunch(*args), fragment)


@pytest.mark.parametrize(
    "args, fragment",
    [
        # Issue 48. 4: the run id (the name and a hash) names worker_lib's node cache folder: each
        # rank died in ft.init with 'File name too long' (exit 3).
        (["--run-name", "a" * 250, str(ACTOR)], "--run-name is 250 bytes long, at most 246"),
        # 3: it said "run ...: new", then the workers' store could not listen (exit 1).
        (["--metrics-port", "29611", "--master-port", "29611", str(ACTOR)], "both name port 29611"),
        # 5: every rank had its own memory filesystem: nothing saved was loaded, a crash loop.
        (
            ["--checkpoint-dir", "memory://x", str(ACTOR)],
            "checkpoint storage (--checkpoint-dir) memory://x: fsspec keeps it inside the process",
        ),
        (["--checkpoint-dir", "simplecache::memory://x", str(ACTOR)], "fsspec keeps it inside the process"),
        (["--run-dir", "memory://runs", str(ACTOR)], "run dir (--run-dir) memory://runs/actor-"),
        # 6d: it fell back to the default name.
        (["--run-name", "", str(ACTOR)], "--run-name is empty"),
        # 6a: it said "script not found: tests".
        (["tests"], "tests is a directory, not a Python script"),
    ],
)
def test_refused_before_anything_is_written(ftlaunch, tmp_path, args, fragment):
    """No run folder, no checkpoints/ or logs/ left behind, no worker started."""
    launch = ftlaunch(*args)
    _assert_usage_error(launch, fragment)
    assert not (tmp_path / "runs").exists() and not launch.log_dir.exists()


def test_node_0_refuses_more_nodes_than_its_open_file_limit_can_connect(launcher):
    """Node 0 hosts the job's store: each node connects to it, within node 0's ulimit -n."""
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))"
    args = ["--nnodes", "2:3000", "--rdzv-endpoint", "127.0.0.1:1", str(ACTOR)]
    _assert_usage_error(
        launcher.run(*args, prelude=prelude), "node 0 hosts the job's store and needs about 6067 open files"
    )


def test_unwritable_log_dir(launcher, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _assert_usage_error(launcher.run(str(ACTOR), log_dir=blocker / "logs"), "is not writable")


def test_busy_master_port_is_a_usage_error(launcher):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        launch = launcher.run("--master-port", str(port), str(ACTOR))
    _assert_usage_error(launch, f"cannot listen on 127.0.0.1:{port}")


def test_options_from_ftlaunch_environment_variables(launcher, tmp_path):
    envs = tmp_path / "env"
    launch = launcher.run(
        str(ACTOR), "--env-dir", str(envs), env={"FTLAUNCH_NPROC": "3", "FTLAUNCH_MAX_FAILURES": "7"}
    )
    assert launch.proc.returncode == 0, launch.stderr
    assert len(list(envs.iterdir())) == 3
    assert '"TORCHELASTIC_MAX_RESTARTS": "7"' in (envs / "rank_2.attempt_0.json").read_text()


def test_bad_environment_variable_is_a_usage_error(ftlaunch, tmp_path):
    _assert_usage_error(ftlaunch(str(ACTOR), env={"FTLAUNCH_BACKEND": "mpi"}), "'mpi' is not one of")
    # Issue 48.6b: preflight's errors name their option, so the variable is said too.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    launch = ftlaunch(str(ACTOR), env={"FTLAUNCH_CHECKPOINT_DIR": str(blocker / "ckpt")})
    _assert_usage_error(launch, "checkpoint storage (--checkpoint-dir) '")
    assert launch.stderr.rstrip().endswith(
        f"(--checkpoint-dir came from FTLAUNCH_CHECKPOINT_DIR={blocker}/ckpt)"
    )


def test_only_the_command_line_asks_for_the_version_or_the_help(launcher, ftlaunch):
    """A stray FTLAUNCH_VERSION=1 (or PET_VERSION, or --help's variable under its names in older
    and newer clicks) printed the version or the help and exited 0: the run was skipped."""
    stray = {name: "1" for name in ("FTLAUNCH_VERSION", "PET_VERSION", "FTLAUNCH_HELP", "PET_HELP")}
    stray["FTLAUNCH__CLICK_DEFAULT_HELP"] = "1"  # click 8.5's name for --help's value
    launch = launcher.run("--nproc", "1", str(ACTOR), "--run-for", "0", env=stray)
    assert launch.proc.returncode == 0, launch.stderr
    assert launch.run_state().attempts[0].outcome == "SUCCEEDED", launch.stdout
    assert "version" not in launch.stdout and "Usage:" not in launch.stdout
    assert launch.survivors() == []
    assert ftlaunch("--version").stdout.startswith("ftlaunch, version ")  # as the command line asks


def test_everything_after_the_script_belongs_to_the_script(launcher, tmp_path):
    # --nproc after SCRIPT goes to the script (which rejects it), not to ftlaunch.
    launch = launcher.run("--max-failures", "0", str(ACTOR), "--nproc", "5")
    assert launch.proc.returncode == 1
    assert "actor.py: error: unrecognized arguments: --nproc 5" in launch.stderr


def test_module_mode(launcher, tmp_path):
    out = tmp_path / "out.json"
    (tmp_path / "in.json").write_text('{"a": 1}')
    launch = launcher.run("-m", "json.tool", str(tmp_path / "in.json"), str(out))
    assert launch.proc.returncode == 0, launch.stderr
    assert out.read_text().strip() == '{\n    "a": 1\n}'


def test_no_python_mode(launcher, tmp_path):
    launch = launcher.run("--nproc", "2", "--no-python", "sh", "-c", 'echo "rank=$RANK of $WORLD_SIZE"')
    assert launch.proc.returncode == 0, launch.stderr
    assert "[0] rank=0 of 2" in launch.stdout and "[1] rank=1 of 2" in launch.stdout


def test_a_script_that_cannot_start_is_a_usage_error(ftlaunch, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n\ndef main(:\n    pass\n")
    _assert_usage_error(ftlaunch(str(broken)), "broken.py, line 3: SyntaxError: ")
    program = tmp_path / "program"
    program.write_bytes(Path(shutil.which("true")).read_bytes())  # an ELF binary, run as a script
    _assert_usage_error(ftlaunch(str(program)), "is not a Python script (a program? --no-python runs")


def test_unusable_checkpoint_dir_is_a_usage_error(ftlaunch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _assert_usage_error(ftlaunch("--checkpoint-dir", str(blocker / "ckpt"), str(ACTOR)), "is not usable")


def test_storage_without_write_permission_is_a_usage_error(launcher, tmp_path):
    import s3fs

    server, reader = start_s3_read_only(tmp_path, bucket="ckpt")
    try:
        launch = launcher.run("--checkpoint-dir", "s3://ckpt/run", str(ACTOR), env=reader)
        # The same keys may read: what was refused is the write, not the credentials.
        listed = s3fs.S3FileSystem(
            key=reader["AWS_ACCESS_KEY_ID"],
            secret=reader["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=reader["FSSPEC_S3_ENDPOINT_URL"],
        ).ls("ckpt")
    finally:
        server.stop()
    _assert_usage_error(
        launch, "checkpoint storage (--checkpoint-dir) 's3://ckpt/run' is not usable: PermissionError"
    )
    assert "Access Denied" in launch.stderr
    assert listed == []


def test_missing_bucket_is_a_usage_error(launcher, gcs_env):
    launch = launcher.run("--checkpoint-dir", "gcs://no-such-bucket-here/run", str(ACTOR), env=gcs_env)
    _assert_usage_error(
        launch, "checkpoint storage (--checkpoint-dir) 'gcs://no-such-bucket-here/run' is not usable"
    )


@pytest.mark.parametrize("answer", ["never", "refused"])
def test_storage_that_does_not_answer_is_one_line_within_the_storage_timeout(launcher, answer):
    """A GCS endpoint that accepts and never answers, or refuses: gcsfs alone would retry for a minute
    and log tracebacks; ftlaunch gives up after --storage-timeout with one line."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        if answer == "never":
            silent.listen(16)  # connections complete in the backlog; no byte ever comes back
        port = silent.getsockname()[1]
        env = {"FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GCS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        launch = launcher.start(
            "--storage-timeout", "3", "--checkpoint-dir", "gs://bucket/x", str(ACTOR), env=env
        )
        launch.wait(timeout=40)  # the bound itself: gcsfs's own retries take a minute or more
    _assert_usage_error(
        launch,
        "checkpoint storage (--checkpoint-dir) 'gs://bucket/x' did not answer within 3 s (--storage-timeout)",
    )
    if answer == "refused":
        assert "last error:" in launch.stderr and f"127.0.0.1:{port}" in launch.stderr


def test_a_credential_look_up_that_never_ends_is_within_the_storage_timeout(launcher):
    """No token: gcsfs looks for credentials, and asks the machine's metadata server, which here
    takes every connection and never answers (seconds per try, three tries). The check's clock
    covers building the filesystem, not only the probe's write."""
    with socket.socket() as metadata:
        metadata.bind(("127.0.0.1", 0))
        metadata.listen(16)
        where = f"127.0.0.1:{metadata.getsockname()[1]}"
        env = {"GCE_METADATA_HOST": where, "GCE_METADATA_IP": where}
        env["FSSPEC_GCS_ENDPOINT_URL"] = "http://127.0.0.1:1"
        launch = launcher.start(
            "--storage-timeout", "3", "--run-dir", "gs://no-such-bucket/x", str(ACTOR), env=env
        )
        launch.wait(timeout=60)
        metadata.settimeout(1.0)
        metadata.accept()[0].close()  # the look-up did reach it (its connection waits in the backlog)
    _assert_usage_error(
        launch, "did not answer within 3 s (--storage-timeout); it was still setting up its filesystem"
    )


@pytest.mark.parametrize("option", ["--checkpoint-dir", "--run-dir"])
def test_a_server_that_refuses_the_connection_is_one_line(launcher, option):
    """fsspec's FTP filesystem connects when it is built: the refusal is the library's own
    exception, not a StorageError."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        url = f"ftp://127.0.0.1:{closed.getsockname()[1]}/x"
        launch = launcher.run(option, url, str(ACTOR))
    _assert_usage_error(launch, "is not usable: ConnectionRefusedError")


def test_a_node_without_a_gpu_driver_counts_no_gpu_without_importing_torch():
    """Counting GPUs through torch costs the supervisor seconds of import before any worker starts;
    on a node with no GPU driver's device files there is nothing to count."""
    from launcher.cli.discover import _GPU_DRIVER_FILES

    if any(Path(p).exists() for p in _GPU_DRIVER_FILES):
        pytest.skip("this node has a GPU driver: torch counts its GPUs")
    probe = "import sys; from launcher.cli.discover import visible_gpu_count; "
    probe += "print(visible_gpu_count(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "False"]


def test_a_script_named_status_in_the_working_directory_is_launched(tmp_path):
    """``ftlaunch status ...`` beside a file named ``status`` runs that script, as ``ftlaunch
    ./status ...`` would, every word after it the script's (tests/unit/test_cli_commands.py has
    the dispatch's other cases). A process of its own: a launch makes its process a child
    subreaper, which a test's process must never become."""
    (tmp_path / "status").write_text(
        "import json, sys\nfrom pathlib import Path\nPath('argv.json').write_text(json.dumps(sys.argv[1:]))\n"
    )
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(ROOT), "FTLAUNCH_NPROC": "1"}
    env["FTLAUNCH_FORK_SERVER"] = "0"  # torch-free
    argv = [sys.executable, "-m", "launcher", "status", "--json", "--run-dir", "elsewhere"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--json", "--run-dir", "elsewhere"]
    assert [p.name for p in (tmp_path / "ftlaunch_runs").iterdir()][0].startswith("status")
    assert not (tmp_path / "elsewhere").exists() and processes_with_marker(marker) == []
