"""The fork server: a worker forked from the warm zygote is, to its script, the worker a new
interpreter would have been (the script's imports run in it, after the fork); each attempt's
workers are fresh forks; and whenever the zygote cannot serve, ftlaunch says so in one line and
starts workers as new processes."""

import json
import os
import re
import signal
import socket
import time
import zipfile

import fsspec
import psutil
import pytest
import torch
from conftest import use_emulator
from helpers import ACTOR, SCRIPTS, wait_for_files
from test_stopping import _wait_dead

from launcher.core.events import WorkerExit
from launcher.forked.protocol import STORE_HOST_TITLE, ZYGOTE_MODULE

PROBE = str(SCRIPTS / "probe.py")
TRAIN = str(SCRIPTS / "ckpt_train.py")


def _probes(folder, attempt, nproc=2):
    return [json.loads((folder / f"rank_{r}.attempt_{attempt}.json").read_text()) for r in range(nproc)]


def _zygote_of(launch) -> psutil.Process:
    children = psutil.Process(launch.proc.pid).children()
    return next(p for p in children if ZYGOTE_MODULE in " ".join(p.cmdline()))


def test_a_forked_worker_sees_what_a_new_interpreter_sees(launcher, tmp_path):
    forked, spawned = tmp_path / "forked", tmp_path / "spawned"
    args = ["--leak", "--crash-rank", "1"]
    fork_run = launcher.run("--nproc", "2", "--run-name", "f", PROBE, str(forked), *args)
    plain_run = launcher.run("--nproc", "2", "--no-fork-server", "--run-name", "p", PROBE, str(spawned))
    assert fork_run.proc.returncode == 0 and plain_run.proc.returncode == 0, fork_run.stderr
    assert "fork server off" not in fork_run.stderr
    for ours, theirs in zip(_probes(forked, 0), _probes(spawned, 0)):
        assert ours["forked"] and not theirs["forked"]  # the fork server really served
        same = [
            "name",
            "path0",
            "cwd",
            "own_session",
            "stdin",
            "usr1",
            "sigint",
            "stdout",
            "torch_threads",
            "gc",
        ]
        same += ["file", "loader", "spec"]  # an absolute __file__, a source loader, no spec
        same += ["storage_imported"]  # none, with a local checkpoint folder
        assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
        # ps shows the script's command line, and /proc/PID/environ the rank's variables
        for probe in (ours, theirs):
            assert probe["cmdline"][1:] == ["-u", PROBE, *probe["argv"][1:]] and probe["environ_rank"]
        assert ours["argv"][0] == theirs["argv"][0] == PROBE and ours["argv"][2:] == args
        assert ours["ppid"] == fork_run.proc.pid  # the supervisor's child, as a spawned worker is
    assert ours["name"] == "__main__" and ours["usr1"] == "ignored" and ours["stdin"] == "/dev/null"
    # Random streams: never shared between two ranks or two attempts (as in new interpreters).
    draws = _probes(forked, 0) + _probes(forked, 1)
    for key in ("torch_seed", "numpy_draw", "random_draw"):
        assert len({d[key] for d in draws}) == 4, key
    # Attempt 1 is a fresh fork of the zygote, not of attempt 0's workers.
    assert not any(d["leaked"] for d in _probes(forked, 1))
    assert launcher.launches[0].survivors() == []


def test_a_module_run_with_dash_m_is_forked_too(launcher, tmp_path):
    out = tmp_path / "probes"
    launch = launcher.run("--nproc", "2", "-m", "tests.scripts.probe", str(out))
    assert launch.proc.returncode == 0, launch.stderr
    probes = _probes(out, 0)
    assert all(p["forked"] and p["name"] == "__main__" for p in probes)
    assert probes[0]["argv"][0] == str(SCRIPTS / "probe.py")  # as `python -m` sets it
    assert launch.survivors() == []


def test_a_forked_worker_finds_its_checkpoint_storage_imported(launcher, tmp_path, gcs_env, monkeypatch):
    """gcsfs costs 0.4 s to import: the zygote imports it once, not every rank of every
    restart; the ranks still draw random streams of their own."""
    use_emulator("gcs", gcs_env, monkeypatch)
    fsspec.filesystem("gcs").mkdir("warm-storage")
    out = tmp_path / "probes"
    launch = launcher.run(
        "--nproc", "2", "--checkpoint-dir", "gcs://warm-storage/run", PROBE, str(out), env=gcs_env
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr
    probes = _probes(out, 0)
    assert all(p["forked"] and p["storage_imported"] == ["gcsfs"] for p in probes), probes
    assert len({p["random_draw"] for p in probes}) == 2
    assert launch.survivors() == []


def test_a_run_is_bit_identical_with_and_without_the_fork_server(launcher, tmp_path):
    """DDP with a crash and a resume under the fork server, against a run without crash or
    fork server: worker_lib restores model, optimizer and every RNG the same way."""
    forked, plain = tmp_path / "forked.pt", tmp_path / "plain.pt"
    a = launcher.run(
        "--nproc", "2", "--run-name", "f", TRAIN, "--out", str(forked), "--crash", "7:0", timeout=180
    )
    b = launcher.run(
        "--nproc", "2", "--no-fork-server", "--run-name", "p", TRAIN, "--out", str(plain), timeout=180
    )
    assert a.proc.returncode == 0 and b.proc.returncode == 0, a.stderr
    assert "fork server off" not in a.stderr
    x, y = torch.load(forked), torch.load(plain)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_preloaded_import_that_fails_in_the_zygote_falls_back(launcher, tmp_path):
    """The script's own imports run in its workers (an optional one may fail there, as it would
    under torchrun); one named by --preload that fails turns the fork server off, said."""
    script = tmp_path / "optional_import.py"
    script.write_text(
        "try:\n    import not_a_module_ftlaunch_test\nexcept ImportError:\n    pass\n"
        "print('ran', flush=True)\n"
    )
    own = launcher.run("--nproc", "2", "--run-name", "own", str(script))
    named = launcher.run("--nproc", "2", "--preload", "not_a_module_ftlaunch_test", str(script))
    for launch in (own, named):
        assert launch.proc.returncode == 0, launch.stderr
        assert launch.stdout.count("ran") == 2
    assert "fork server off" not in own.stderr
    said = "fork server off: it could not import not_a_module_ftlaunch_test (ModuleNotFoundError"
    assert said in named.stderr
    assert all(launch.survivors() == [] for launch in launcher.launches)


def test_a_preloaded_import_that_leaves_a_thread_falls_back(launcher, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    script = tmp_path / "uses_it.py"
    script.write_text("import starts_a_thread\nprint('ran', flush=True)\n")
    env = {"PYTHONPATH": str(lib)}
    own = launcher.run("--nproc", "1", "--run-name", "own", str(script), env=env)  # its thread, in it
    named = launcher.run("--nproc", "1", "--preload", "starts_a_thread", str(script), env=env)
    for launch in (own, named):
        assert launch.proc.returncode == 0 and "ran" in launch.stdout, launch.stderr
    assert "fork server off" not in own.stderr
    assert "fork server off: importing left 1 thread(s) running in it" in named.stderr
    # what it costs, measured: each new process imports what the fork server did
    paid = r"starting workers as new processes \(each imports what it imported: [\d.]+ s here\)"
    assert re.search(paid, named.stderr), named.stderr
    assert all(launch.survivors() == [] for launch in launcher.launches)


def test_a_module_that_reads_its_rank_at_import_sees_its_own(launcher, tmp_path):
    """Modules are imported in each worker, which reads its own rank; a library named by --preload
    that reads a rank's variable at import, with or without a default (Lightning's rank_zero_only
    reads RANK with one), turns the fork server off, said in one line: no rank ever sees rank 0's
    value, or the default, for its own."""
    lib = tmp_path / "lib"
    lib.mkdir()
    reads = {"own": "os.environ['RANK']", "lib": "os.environ['RANK']", "dflt": "os.environ.get('RANK', '0')"}
    for kind, read in reads.items():
        folder = tmp_path if kind == "own" else lib
        (folder / f"{kind}_reads_rank.py").write_text(f"import os\nRANK = {read}\n")
    shows = [
        f"print('{kind}', {kind}_reads_rank.RANK, 'env', os.environ['RANK'], flush=True)" for kind in reads
    ]
    script = tmp_path / "show.py"
    script.write_text(
        "import os\n" + "".join(f"import {kind}_reads_rank\n" for kind in reads) + "\n".join(shows)
    )
    env = {"PYTHONPATH": str(lib)}
    runs = {name: ["--preload", f"{name}_reads_rank"] for name in ("lib", "dflt")}
    for name, options in {"own": [], **runs}.items():
        run = launcher.run("--nproc", "2", "--run-name", name, *options, str(script), env=env)
        assert run.proc.returncode == 0, run.stderr
        for kind in reads:
            assert f"[0] {kind} 0 env 0" in run.stdout and f"[1] {kind} 1 env 1" in run.stdout
        said = f"fork server off: importing {name}_reads_rank reads RANK (a rank's own) at import"
        assert (said in run.stderr) if options else ("fork server off" not in run.stderr), run.stderr
    assert all(launch.survivors() == [] for launch in launcher.launches)


def test_a_dead_zygote_falls_back_and_the_run_goes_on(launcher, tmp_path):
    ready = tmp_path / "ready"
    launch = launcher.start(
        "--nproc", "2", str(ACTOR), "--fail", "exit", "--others", "wait", "--fail-after", "60",
        "--ready-dir", str(ready),
    )  # fmt: skip
    wait_for_files(ready, "rank_*.attempt_0.pid", 2, timeout=60)
    zygote = _zygote_of(launch)
    zygote.send_signal(signal.SIGKILL)
    _wait_dead(zygote)  # a zombie until the supervisor looks at it: dead enough
    for pid_file in ready.glob("rank_1.attempt_0.pid"):  # now make rank 1 fail: a restart is due
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert launch.wait(120) == 0, launch.stderr
    assert re.search(r"fork server off: it (stopped answering|died)", launch.stderr), launch.stderr
    assert "attempt 1: starting 2 worker(s)" in launch.stderr
    assert launch.survivors() == []


def test_every_request_to_a_frozen_fork_server_ends_at_its_deadline(tmp_path):
    """A zygote frozen (SIGSTOP) answers nothing: each request the supervisor sends it (a group's
    workers, a spare, the store host, the processes forked ahead during a stop) is given up on
    after ``ANSWER_S``, not 30 s (a refill's spare asked for while the group runs held the
    supervisor's loop, a crash included, for as long)."""
    from launcher.core.config import EntrySection
    from launcher.process.forkserver import ANSWER_S, ForkServer, ForkServerUnavailable
    from launcher.process.plan import WorkerSpec

    script = tmp_path / "empty.py"
    script.write_text("")
    server = ForkServer(EntrySection(str(script)), tmp_path / "forkserver.log")
    server.launch(dict(os.environ))
    read, write = os.pipe()
    try:
        server.await_ready(300.0)
        os.kill(server.pid, signal.SIGSTOP)
        spec = WorkerSpec(0, 0, ("python", str(script)), {"RANK": "0"}, tmp_path / "log", tmp_path / "err")
        requests = {
            "workers": lambda: server.fork([spec], [(write, write)]),
            "spare": lambda: server.fork_spare(0, cuda=False),
            "store host": server.fork_store,
            "forked ahead": lambda: (server.send_parked([0]), server.settle()),
        }
        for name, ask in requests.items():
            started = time.monotonic()
            with pytest.raises(ForkServerUnavailable, match=f"no answer to fork within {ANSWER_S:g} s"):
                ask()
            took = time.monotonic() - started
            assert ANSWER_S <= took < 8.0, f"{name}: {took:.1f} s"  # a few seconds: it was 30
    finally:
        os.close(read)
        os.close(write)
        server.close()  # SIGKILL: a stopped process dies of it too
    assert server.pid is not None and not psutil.pid_exists(server.pid)


def test_many_ranks_forked_at_once_all_start(launcher, tmp_path):
    """Twelve forks in a row on two cores: the middle process may exit before or after its
    worker first runs (CI once caught a worker that waited 10 s for a parent it already had)."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'up', flush=True)\n")
    launch = launcher.run("--nproc", "12", "--max-failures", "0", str(script), timeout=120)
    assert launch.proc.returncode == 0, launch.stderr
    assert "fork server off" not in launch.stderr
    up = [int(line.split()[2]) for line in launch.stdout.splitlines() if line.endswith(" up")]
    assert sorted(up) == list(range(12))
    assert launch.survivors() == []


def test_a_command_line_and_environment_too_large_for_the_fork_server_are_said_and_spawned(
    launcher, tmp_path
):
    big = {f"FTLAUNCH_TEST_BIG_{i}": "x" * 60_000 for i in range(5)}  # more than one datagram carries
    launch = launcher.run("--nproc", "1", str(ACTOR), "--run-for", "0", env=big, timeout=120)
    assert launch.proc.returncode == 0, launch.stderr
    assert "more than one request to it can carry" in launch.stderr, launch.stderr
    assert launch.survivors() == []


def test_a_preloaded_librarys_random_stream_made_at_import_differs_per_rank_and_attempt(launcher, tmp_path):
    """`_rng = random.Random()` in a library preloaded in the zygote: a new interpreter would seed
    each rank's from the OS, and so must each fork (the one stream a fork can reseed)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "lib_rng.py").write_text("import random\nRNG = random.Random()\nSEEDED = random.Random(7)\n")
    script = tmp_path / "draw.py"
    script.write_text(
        "import os, sys\nimport lib_rng\n"
        "rank, attempt = os.environ['RANK'], os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "print('draw', rank, attempt, lib_rng.RNG.random(), lib_rng.SEEDED.random(), flush=True)\n"
        "sys.exit(1 if (rank, attempt) == ('1', '0') else 0)\n"
    )
    args = ["--nproc", "2", "--max-failures", "1", "--preload", "lib_rng"]
    launch = launcher.run(*args, str(script), env={"PYTHONPATH": str(lib)})
    assert launch.proc.returncode == 0 and "fork server off" not in launch.stderr, launch.stderr
    draws = re.findall(r"draw (\d) (\d) (\S+) (\S+)", launch.stdout)
    assert len(draws) == 4, launch.stdout
    assert len({d[2] for d in draws}) == 4  # no two ranks or attempts share the OS-seeded stream
    assert len({d[3] for d in draws}) == 1  # a seeded one is the same everywhere, as it would be
    assert launch.survivors() == []


# A library that makes generators and looks at its process while it is imported.
IMPORT_STATE = """
import os, sys
import numpy as np
import torch
RNG = np.random.default_rng()
LEGACY = np.random.RandomState()
TORCH_SEED = torch.Generator().seed()
ARGV = list(sys.argv)
MAIN_FILE = getattr(sys.modules["__main__"], "__file__", None)
PID = os.getpid()
"""
DRAW_STATE = """
import json, os, sys
import import_state as s
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
seen = {
    "pid": os.getpid(), "argv": sys.argv, "lib_pid": s.PID, "lib_argv": s.ARGV, "lib_main": s.MAIN_FILE,
    "rng": float(s.RNG.random()), "legacy": float(s.LEGACY.random_sample()), "torch_seed": s.TORCH_SEED,
}
with open(os.path.join(sys.argv[1], f"{rank}.{attempt}.json"), "w") as out:
    json.dump(seen, out)
sys.exit(1 if (rank, attempt) == ("1", "0") else 0)
"""


@pytest.mark.parametrize("preload", [False, True])
def test_what_a_library_makes_at_import_is_each_workers_own_unless_preloaded(launcher, tmp_path, preload):
    """numpy's default_rng() and RandomState(), torch.Generator().seed(), sys.argv,
    __main__.__file__ and the pid, taken while a library is imported: by default each of 4 workers
    (2 ranks, one restart) has its own, as under torchrun (the library is imported after the
    fork). Named by --preload, it is imported once in the fork server, and every worker shares
    what it made then, as the option's help says."""
    lib, out = tmp_path / "lib", tmp_path / "out"
    lib.mkdir()
    out.mkdir()
    (lib / "import_state.py").write_text(IMPORT_STATE)
    script = tmp_path / "draw_state.py"
    script.write_text(DRAW_STATE)
    args = ["--nproc", "2", "--max-failures", "1", *(["--preload", "import_state"] if preload else [])]
    launch = launcher.run(*args, str(script), str(out), env={"PYTHONPATH": str(lib)})
    assert launch.proc.returncode == 0 and "fork server off" not in launch.stderr, launch.stderr
    seen = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    assert len(seen) == 4 and len({s["pid"] for s in seen}) == 4
    for key in ("rng", "legacy", "torch_seed", "lib_pid"):
        assert len({s[key] for s in seen}) == (1 if preload else 4), key
    for s in seen:
        assert s["argv"] == [str(script), str(out)]
        if preload:
            assert s["lib_pid"] != s["pid"] and s["lib_main"] != str(script)  # the fork server's
        else:
            assert (s["lib_pid"], s["lib_argv"], s["lib_main"]) == (s["pid"], s["argv"], str(script))
    assert launch.survivors() == []


def test_a_package_of_the_scripts_own_tree_is_never_taken_from_an_installed_copy(launcher, tmp_path):
    """repo/scripts/train.py puts repo on sys.path and imports repo/mypkg, while an older mypkg
    is installed: warm, the zygote would import the installed one for every worker. Without the
    installed copy, the same layout keeps the fork server on."""
    repo, installed = tmp_path / "repo", tmp_path / "site"
    for folder, version in ((repo / "mypkg", "new"), (installed / "mypkg", "old")):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text(f"VERSION = {version!r}\n")
    (repo / "scripts").mkdir()
    script = repo / "scripts" / "train.py"
    script.write_text(
        "import os, sys\nsys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
        "import mypkg\nprint('version', mypkg.VERSION, flush=True)\n"
    )
    stale = launcher.run(
        "--nproc", "2", "--run-name", "stale", str(script), env={"PYTHONPATH": str(installed)}
    )
    alone = launcher.run("--nproc", "2", "--run-name", "alone", str(script))
    for launch in (stale, alone):
        assert launch.proc.returncode == 0 and "fork server off" not in launch.stderr, launch.stderr
        assert launch.stdout.count("version new") == 2, launch.stdout
    assert all(launch.survivors() == [] for launch in launcher.launches)


def test_a_forked_scripts_traceback_is_the_one_a_new_interpreter_prints(launcher, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def inner():\n    raise ValueError('from the script')\n\n\ninner()\n")
    frames = {}
    for mode in ("--fork-server", "--no-fork-server"):
        launch = launcher.run(
            "--nproc", "1", "--max-failures", "0", "--run-name", mode[2:], mode, str(script)
        )
        assert launch.proc.returncode == 1, launch.stderr
        assert "fork server off" not in launch.stderr, launch.stderr
        log = (launch.log_dir / "attempt_0" / "rank_0.log").read_text()
        frames[mode] = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', log)
        assert "ValueError: from the script" in log
    assert (
        frames["--fork-server"]
        == frames["--no-fork-server"]
        == [
            (str(script), "5", "<module>"),
            (str(script), "2", "inner"),
        ]
    )
    assert all(launch.survivors() == [] for launch in launcher.launches)


# A script's end, each way it can end, with what an exit must still do (or must not get stuck on),
# each a break found from outside: what the interpreter does at exit that a script can see.
_ENDING = """
import atexit, fcntl, os, signal, struct, sys, tempfile, termios, threading, time, zipfile
out = sys.argv[1]
here = lambda name: os.path.join(out, name)
def on_term(signum, frame):  # the main thread gets it while the exit joins the thread below
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
def later():  # a non-daemon thread: the exit waits for it (and is interrupted while it does)
    threading.main_thread().join()
    with open(here("thread"), "w") as f:
        f.write("after main")
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
threading.Thread(target=later).start()
atexit.register(lambda: open(here("atexit"), "w").write("ran"))
text = open(here("text"), "w")  # left open, its data still in the buffer
text.write("buffered text")
raw = open(here("binary"), "wb")
raw.write(b"buffered bytes")
archive = zipfile.ZipFile(here("archive.zip"), "w")  # left open: its directory is written at exit
archive.writestr("inside", "zipped")
temporary = tempfile.NamedTemporaryFile(dir=out, prefix="temporary-")  # removed at exit
class Said:  # its __del__ uses no builtin: at exit the interpreter has none left
    def __init__(self):
        self.file = open(here("del"), "w")
    def __del__(self):
        self.file.write("ran")
        self.file.close()
said = Said()
sys.stdout = open(here("stdout"), "w")  # a script's own stdout, never flushed by it
print("printed")
# A daemon thread stuck writing into a full pipe, holding its file's lock (held by it alone: the
# interpreter would abort on one of __main__'s, which it closes at exit).
reader, writer = os.pipe()
threading.Thread(target=os.fdopen(writer, "wb").write, args=(b"x" * (1 << 20),), daemon=True).start()
deadline = time.monotonic() + 60
while struct.unpack("i", fcntl.ioctl(reader, termios.FIONREAD, b"1234"))[0] < 4096:
    assert time.monotonic() < deadline
    time.sleep(0.01)
end = sys.argv[2]
if end == "code":
    sys.exit(7)
if end == "message":
    sys.exit("stopped: a message")
if end == "past a C long":
    sys.exit(2**63)
"""
_STATUS = {"return": 0, "code": 7, "message": 1, "past a C long": 255}


@pytest.mark.parametrize("end", sorted(_STATUS))
def test_a_forked_worker_ends_as_a_new_interpreter_does(launcher, tmp_path, end):
    """A forked worker leaves without tearing the zygote's modules down (worker_exit.leave: 0.4-0.6
    s of CPU a rank): its exit status and message, its non-daemon threads, a signal while they are
    joined, its atexit functions, the files it left open, what its objects do when freed, a
    stdout of its own, and a daemon thread stuck holding a file are a new interpreter's."""
    script = tmp_path / "ending.py"
    script.write_text(_ENDING)
    seen = {}
    for mode in ("--fork-server", "--no-fork-server"):
        out = tmp_path / mode[2:]
        out.mkdir()
        launch = launcher.run(
            "--nproc", "1", "--max-failures", "0", "--run-name", mode[2:], mode, str(script), str(out), end
        )  # fmt: skip
        assert "fork server off" not in launch.stderr, launch.stderr
        log = (launch.log_dir / "attempt_0" / "rank_0.log").read_text()
        with zipfile.ZipFile(out / "archive.zip") as archive:
            zipped = archive.read("inside").decode()
        files = {path.name: path.read_text() for path in out.iterdir() if path.name != "archive.zip"}
        exits = [e.exitcode for e in launch.events(WorkerExit)]
        seen[mode] = (exits, files, zipped, "stopped: a message" in log, "Exception ignored in" in log)
    assert seen["--fork-server"] == seen["--no-fork-server"]
    codes, files, zipped, said, ignored = seen["--fork-server"]
    assert codes == [_STATUS[end]]
    assert files == {
        "thread": "after main",
        "atexit": "ran",
        "text": "buffered text",
        "binary": "buffered bytes",
        "del": "ran",
        "stdout": "printed\n",
    }  # and no temporary-* left
    assert zipped == "zipped" and said == (end == "message") and ignored
    assert all(launch.survivors() == [] for launch in launcher.launches)


def test_one_forked_store_host_serves_each_attempt_and_a_dead_one_is_replaced(launcher, tmp_path):
    """On one node the attempts' stores are served by a process forked from the zygote, which has
    torch loaded already: the supervisor never loads it. The same host serves attempt after
    attempt (a restart waits for a message, not a fork), the last attempt's port closed first; one
    killed is replaced at the next attempt, and it is gone with the run."""
    ready = tmp_path / "ready"
    launch = launcher.start(
        "--nproc", "2", str(ACTOR), "--fail", "exit", "--others", "wait", "--fail-after", "60",
        "--run-for", "60", "--ready-dir", str(ready),
    )  # fmt: skip
    wait_for_files(ready, "rank_*.attempt_0.pid", 2, timeout=60)
    supervisor = psutil.Process(launch.proc.pid)
    host = _store_host_of(supervisor)
    assert not [m.path for m in supervisor.memory_maps() if "libtorch" in m.path]
    ports = [_store_port(ready, 0)]
    os.kill(int((ready / "rank_1.attempt_0.pid").read_text()), signal.SIGKILL)  # a restart is due
    wait_for_files(ready, "rank_*.attempt_1.pid", 2, timeout=60)
    ports.append(_store_port(ready, 1))
    assert _store_host_of(supervisor).pid == host.pid
    assert _listening(host) == {ports[1]}  # attempt 0's store is closed
    host.kill()
    _wait_dead(host)
    os.kill(int((ready / "rank_1.attempt_1.pid").read_text()), signal.SIGKILL)
    wait_for_files(ready, "rank_*.attempt_2.pid", 2, timeout=60)
    replaced = _store_host_of(supervisor)
    assert replaced.pid != host.pid and _listening(replaced) == {_store_port(ready, 2)}
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.wait(60) == 143, launch.stderr
    assert "fork server off" not in launch.stderr and "store host:" not in launch.stderr
    assert launch.survivors() == []


def test_a_fixed_master_port_serves_every_attempt(launcher, tmp_path):
    """--master-port: each attempt's store listens on the same port, so the last one must be
    closed (not only asked to go) before the next binds it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launch = launcher.run(
        "--nproc", "2", "--master-port", str(port), TRAIN, "--out", str(tmp_path / "out.pt"),
        "--crash", "7:0", "--crash", "12:1", timeout=180,
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.stderr
    assert "attempt 2: starting 2 worker(s)" in launch.stderr
    assert "fork server off" not in launch.stderr and "store host:" not in launch.stderr
    assert launch.survivors() == []


def test_each_forked_worker_holds_only_its_own_pipes(launcher, tmp_path):
    """The ranks are forked in one request, each with every rank's pipes at hand: a worker that
    kept another's open would hold that rank's output open past its exit."""
    script = tmp_path / "pipes.py"
    script.write_text(
        "import json, os, sys\n"
        "fds = [os.path.join('/proc/self/fd', fd) for fd in os.listdir('/proc/self/fd')]\n"
        "links = {os.readlink(fd) for fd in fds if os.path.islink(fd)}\n"
        "pipes = sorted(link for link in links if link.startswith('pipe:'))\n"
        f"open(os.path.join({str(tmp_path)!r}, 'rank_' + os.environ['RANK']), 'w').write(json.dumps(pipes))\n"
    )
    launch = launcher.run("--nproc", "4", "--max-failures", "0", str(script), timeout=120)
    assert launch.proc.returncode == 0, launch.stderr
    assert "fork server off" not in launch.stderr
    held = [set(json.loads((tmp_path / f"rank_{r}").read_text())) for r in range(4)]
    assert all(len(pipes) == 2 for pipes in held), held  # its stdout's and its stderr's
    assert len(set().union(*held)) == 8, held  # nobody else's
    assert launch.survivors() == []


def _store_port(ready, attempt: int) -> int:
    pid = int((ready / f"rank_0.attempt_{attempt}.pid").read_text())
    return int(psutil.Process(pid).environ()["MASTER_PORT"])


def _listening(process: psutil.Process) -> set:
    return {c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _store_host_of(supervisor: psutil.Process) -> psutil.Process:
    (host,) = [p for p in supervisor.children() if _command(p)[:1] == [STORE_HOST_TITLE]]
    return host


def _command(process: psutil.Process) -> list:
    """Its command line; [] for a child that is gone or a zombie (a stopped worker not yet reaped)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _huge_pages_of(pid: int) -> int:
    """Bytes of ``pid``'s anonymous memory backed by huge pages."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def test_the_fork_server_backs_its_memory_with_huge_pages(launcher, tmp_path):
    """Once imported, the zygote collapses its memory (torch's, about 200 MB) to huge pages, so
    that a fork copies a page-table entry per 2 MiB and a forked worker's exit tears down as few
    (what that saves is measured in scripts/bench_fork_server.py and bench_scale.py). Where this
    kernel cannot (MADV_COLLAPSE is Linux 6.1's; THP disabled), there is nothing to see."""
    import ctypes
    import mmap

    from launcher.forked.linux import collapse_to_huge_pages

    probe = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe.write(b"x" * (8 << 20))
    view = ctypes.c_char.from_buffer(probe)
    aligned = -(-ctypes.addressof(view) // (2 << 20)) * (2 << 20)  # a whole huge page inside it
    able = collapse_to_huge_pages(aligned, 2 << 20)
    del view
    probe.close()
    if not able:
        pytest.skip("this kernel cannot collapse memory to huge pages (MADV_COLLAPSE: Linux 6.1, THP on)")
    script = tmp_path / "waits.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\nhere = Path(sys.argv[1])\n"
        "(here / 'started').write_text('')\ndeadline = time.monotonic() + 120\n"
        "while not (here / 'go').exists() and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
    )
    launch = launcher.start("--nproc", "1", str(script), str(tmp_path))
    wait_for_files(tmp_path, "started", 1, timeout=60)
    zygote = _zygote_of(launch)
    deadline = time.monotonic() + 60
    while _huge_pages_of(zygote.pid) < 64 << 20:
        assert time.monotonic() < deadline, f"{_huge_pages_of(zygote.pid) >> 20} MiB in huge pages after 60 s"
        time.sleep(0.1)
    (tmp_path / "go").write_text("")
    assert launch.wait(60) == 0, launch.stderr
    assert "fork server off" not in launch.stderr
    assert launch.survivors() == []
