"""The fork server ("zygote"): a process that has already imported torch and the script's own
top-level imports, and forks one worker per rank on request, so a restart does not pay for a
new interpreter importing torch.

Run as ``python -u -m launcher.process.zygote FD SPEC`` by ``forkserver.ForkServer``; FD is its
end of a SOCK_SEQPACKET socket pair, SPEC a JSON object: the entry point (script or module),
the supervisor's pid, the modules to import first.

Each request is one JSON message (argv, env, cwd) with two file descriptors (the worker's stdout
and stderr pipes); the answer is ``{"pid": N}`` or ``{"error": "..."}``. A worker is forked
twice: the first child forks the worker and exits at once, so the worker is re-parented to the
supervisor (a child subreaper) and the supervisor waits for it like for any child it spawned.

Rules the zygote keeps, each because it broke something when it was not kept:
- No thread when it forks (a lock held by another thread stays locked forever in the child):
  no torch op, no process group, no store; OpenBLAS and OpenMP are kept single-threaded here.
- No CUDA: a CUDA context does not survive fork.
- ``gc.freeze()`` once the imports are done: the children's first collection need not walk (and
  so copy) every page the zygote's objects live in.
"""

import ast
import gc
import json
import os
import signal
import socket
import sys
import time
import traceback
import weakref
from typing import Dict, List, Optional, Sequence, Set, Tuple

from launcher.process.linux import set_parent_death_signal, show_as
from launcher.process.store_host import serve_store

# What every training script imports, directly or lazily at its first DDP step or process group.
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.nn.parallel",
    "torch._dynamo.utils",
    "worker_lib",
)
# In the zygote only: libraries that start their thread pool at import would leave threads behind.
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_MAX_MESSAGE = 1 << 20
_REPARENT_WAIT_S = 10.0


def top_level_imports(script: str) -> List[str]:
    """The modules a script imports at its top level (in ``if``/``try`` blocks too), found
    without running it; relative imports are left out (a script has no package)."""
    try:
        with open(script, "rb") as source:
            tree = ast.parse(source.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    names: List[str] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return list(dict.fromkeys(names))


def _imports_of(spec: dict) -> List[str]:
    """What to import here: the entry point's top-level imports and, through the user's own
    modules (files under the entry point's folder, never run here: they may read a rank's
    environment at import), theirs. For ``-m pkg.mod``, finding its file imports its parent
    packages, as ``python -m`` does."""
    if spec["script"]:
        entry = os.path.realpath(spec["script"])
        home = os.path.dirname(entry)  # sys.path[0] of `python SCRIPT`
        return [name for name in warm_imports(entry, home) if not shadowable(name, home)]
    import importlib.util

    try:
        found = importlib.util.find_spec(spec["module"])
    except (ImportError, ValueError):
        return []  # the worker's own `python -m` says why
    if found is None or not found.origin:
        return []
    entry, home = os.path.realpath(found.origin), os.getcwd()  # sys.path[0] of `python -m`
    return warm_imports(entry, home)


_SHADOW_LEVELS = 4


def shadowable(name: str, home: str) -> bool:
    """Whether the script's own tree holds a package or module of that name: in a folder above
    the script's (or its src/), where a script that puts its repository on sys.path
    (``sys.path.insert(0, repo)``) imports it from. Warm, an installed copy of the same name
    would be the one imported, and every worker would run it instead of the tree's."""
    top = name.split(".")[0]
    folder = home
    for _ in range(_SHADOW_LEVELS):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
        for base in (folder, os.path.join(folder, "src")):
            if os.path.isfile(os.path.join(base, top + ".py")) or os.path.isfile(
                os.path.join(base, top, "__init__.py")
            ):
                return True
    return False


def warm_imports(entry: str, home: str) -> List[str]:
    """The modules outside ``home`` that ``entry`` imports, directly or through modules under
    ``home`` (whose imports are followed instead of running them)."""
    wanted: List[str] = []
    files, done = [entry], set()
    while files:
        path = files.pop()
        if path in done:
            continue
        done.add(path)
        for name in top_level_imports(path):
            local = _local_file(name, home)
            if local is not None:
                files.append(local)
            else:
                wanted.append(name)
    return list(dict.fromkeys(wanted))


def _local_file(name: str, home: str) -> Optional[str]:
    """The file of module ``name`` if it lies under ``home`` (found without importing it)."""
    parts = name.split(".")
    for candidate in (os.path.join(home, *parts) + ".py", os.path.join(home, *parts, "__init__.py")):
        if os.path.isfile(candidate):
            return os.path.realpath(candidate)
    return None


def preload(modules: List[str], rank_vars: Sequence[str] = ()) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
    """Import each module. Returns the ones that failed, with why (one line each), and those that
    read one of ``rank_vars`` (a rank's own variables, absent here) while they were imported:
    warm, such a module would keep what it read for every rank."""
    import importlib

    failed, reads = {}, {}
    for name in modules:
        with _ReadsOf(rank_vars) as read, _RandomsMade():
            try:
                importlib.import_module(name)
            except BaseException as err:  # noqa: BLE001 - a script's import may raise anything, even SystemExit
                failed[name] = f"{type(err).__name__}: {err}".splitlines()[0]
        if read.names:
            reads[name] = sorted(read.names)
    return failed, reads


# random.Random instances the zygote's imports seeded from the OS (weak references): a fresh
# interpreter would have seeded each differently, so every worker reseeds them after the fork.
_OS_SEEDED: List["weakref.ref"] = []


class _RandomsMade:
    """Records the random.Random instances seeded from the OS while it is entered (a library's
    ``_rng = random.Random()`` at import); one with a seed of its own is the same in any process."""

    def __enter__(self) -> "_RandomsMade":
        import random

        self._original = original = random.Random.__init__

        def init(rng, x=None, *args, **kwargs):
            original(rng, x, *args, **kwargs)
            if x is None:
                _OS_SEEDED.append(weakref.ref(rng))

        random.Random.__init__ = init
        return self

    def __exit__(self, *_exc: object) -> None:
        import random

        random.Random.__init__ = self._original


class _ReadsOf:
    """Records the reads of ``names`` in os.environ (``environ[k]``, ``.get``, ``in``,
    ``os.getenv``) while it is entered. The class's method is wrapped, not the mapping: a module
    that did ``from os import environ`` reads through it too."""

    def __init__(self, names: Sequence[str]) -> None:
        self._watched = frozenset(names)
        self.names: Set[str] = set()
        self._original = os._Environ.__getitem__

    def __enter__(self) -> "_ReadsOf":
        original, watched, names = self._original, self._watched, self.names

        def getitem(environ, key):
            if key in watched:
                names.add(key)
            return original(environ, key)

        os._Environ.__getitem__ = getitem
        return self

    def __exit__(self, *_exc: object) -> None:
        os._Environ.__getitem__ = self._original


def _cuda_initialized() -> bool:
    """An import that initialized CUDA (a CUDA context does not survive fork). Asked without
    initializing it."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


_WORKER = -1  # what fork_worker returns in the worker itself


def serve(sock: socket.socket, supervisor: int) -> Optional[Tuple[dict, List[int]]]:
    """Fork a worker for each request until the supervisor closes its end. In a forked worker
    it returns that worker's request and stdio descriptors: the worker runs from ``main``, not
    from inside this loop, so the script's exit unwinds nothing of the zygote's."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)  # stdio (+ a store's socket)
        except OSError:
            return None
        if not data:
            return None
        request = json.loads(data)
        try:
            pid = fork_worker(fds, supervisor)
            answer = {"pid": pid}
        except Exception as err:  # noqa: BLE001 - reported to the supervisor, which falls back
            pid, answer = 0, {"error": f"{type(err).__name__}: {err}"}
        if pid == _WORKER:
            return request, fds
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(answer).encode())


def fork_worker(fds: List[int], supervisor: int) -> int:
    """Fork twice; the grandchild becomes the worker, a child of the supervisor. Returns its pid
    once it leads its own session (the supervisor may signal its group at once); in the worker
    itself, ``_WORKER``."""
    if thread_count() != 1:
        raise RuntimeError(f"{thread_count()} threads in the fork server; forking now could deadlock")
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: it forks the worker and leaves at once
        try:
            os.close(ready_r)
            me = os.getpid()  # asked here: in the worker, getppid() may already be the supervisor
            if os.fork() == 0:
                _detach(supervisor, me, ready_w)
                return _WORKER
        except BaseException:  # noqa: BLE001 - never back into the zygote's loop
            traceback.print_exc()  # to the fork server's log
            os._exit(1)
        os._exit(0)
    os.close(ready_w)
    try:
        os.waitpid(middle, 0)
        return _read_pid(ready_r)
    finally:
        os.close(ready_r)


def _read_pid(ready_r: int) -> int:
    """The worker writes its pid once it leads its session; EOF without it: it died first."""
    data = b""
    while True:
        chunk = os.read(ready_r, 64)
        if not chunk:
            break
        data += chunk
    if not data:
        raise RuntimeError("the worker died as it started")
    return int(data)


def _detach(supervisor: int, middle: int, ready_w: int) -> None:
    """The worker's first moves: its own session, its pid to the zygote, the supervisor as its
    parent, and death with the supervisor (armed only now: the middle process's exit would
    have fired it)."""
    os.setsid()
    os.write(ready_w, str(os.getpid()).encode())
    os.close(ready_w)
    _wait_for_parent_to_be(supervisor, middle)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != supervisor:  # the supervisor died before the signal was armed
        _leave(f"its parent is pid {os.getppid()}, not the supervisor {supervisor}")


def become_worker(request: dict, fds: List[int], sock: socket.socket, rank_vars: Sequence[str] = ()) -> None:
    """The rank's stdio, environment and working directory, fresh random streams, and what ps
    shows: the script's command line, the rank's variables first in its environment."""
    sock.close()
    _wire_stdio(fds[:2])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    _apply_thread_settings()
    env = request["env"]
    first = [k for k in rank_vars if k in env] + [k for k in env if k not in rank_vars]
    argv = request["argv"]
    show_as(os.path.basename(argv[0]), argv, [f"{k}={env[k]}" for k in first])


def _wait_for_parent_to_be(supervisor: int, middle: int) -> None:
    deadline = time.monotonic() + _REPARENT_WAIT_S
    while os.getppid() == middle:
        if time.monotonic() > deadline:
            _leave(f"still a child of pid {middle} after {_REPARENT_WAIT_S:g} s")
        time.sleep(0.0002)


def _leave(why: str) -> None:
    """A worker that cannot become one: a line in the fork server's log, exit 1."""
    print(f"fork server: worker {os.getpid()}: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def _wire_stdio(fds: List[int]) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        if fd > 2:
            os.close(fd)


def _reseed() -> None:
    """A fresh interpreter seeds torch's and numpy's global generators from the OS, and so every
    random.Random a module made at import without a seed; a fork would share the zygote's.
    Python's own global ``random`` reseeds itself after a fork."""
    for made in _OS_SEEDED:
        rng = made()
        if rng is not None:
            rng.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _apply_thread_settings() -> None:
    """The zygote ran single-threaded; the worker gets the intra-op threads a fresh process
    would: OMP_NUM_THREADS when set, else torch's default (the cores it may use)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    wanted = os.environ.get("OMP_NUM_THREADS")
    threads = int(wanted) if wanted and wanted.isdigit() and int(wanted) > 0 else len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)


def run_main(argv: List[str]) -> None:
    """``python -u SCRIPT ARGS`` or ``python -u -m MODULE ARGS``, in this process, called from the
    top of ``main``: SystemExit and KeyboardInterrupt reach the interpreter as a script's would."""
    import runpy

    module, target, args = _parse_argv(argv)
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            _run_script(target)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:  # noqa: BLE001 - as the interpreter does: print it, exit 1
        # Printed from the script's first frame, as a new interpreter would; the exception itself
        # is cut too (3.11 prints the exception's own traceback, not the one passed along).
        trimmed = _script_frames(err.__traceback__)
        sys.excepthook(type(err), err.with_traceback(trimmed), trimmed)
        sys.exit(1)


def _run_script(path: str) -> None:
    """As ``python SCRIPT`` runs it (runpy.run_path does not quite): the code compiled from the
    absolute path, in a fresh ``__main__`` whose ``__file__`` is absolute (a script that changes
    directory still finds its own folder), with a source loader and no spec."""
    import builtins
    import importlib.machinery
    import types

    path = os.path.abspath(path)
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _parse_argv(argv: List[str]) -> Tuple[bool, str, List[str]]:
    """(python, -u, SCRIPT, args...) or (python, -u, -m, MODULE, args...)."""
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if rest[:1] == ["-m"]:
        return True, rest[1], rest[2:]
    return False, rest[0], rest[1:]


def _script_frames(tb):
    """The traceback from the first frame outside runpy and this module: what the script's own
    traceback would show."""
    here = (__file__, getattr(sys.modules.get("runpy"), "__file__", ""), "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename in here:
        tb = tb.tb_next
    return tb


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    spec = json.loads(args[1])
    if spec["script"]:  # sys.path[0] as `python SCRIPT` has it: the script's folder
        sys.path[0] = os.path.dirname(os.path.realpath(spec["script"]))
    rank_vars = spec.get("rank_vars", ())
    failed, reads = preload(list(BASE_PRELOAD) + _imports_of(spec), rank_vars)
    # Best effort: a worker that cannot import its storage's filesystem says why itself.
    reads.update(preload(spec.get("storage", []), rank_vars)[1])
    gc.freeze()
    ready = {"failed": failed, "reads": reads, "threads": thread_count(), "cuda": _cuda_initialized()}
    sock.send(json.dumps(ready).encode())
    job = serve(sock, spec["supervisor"])
    if job is None:
        return
    request, fds = job
    try:
        become_worker(request, fds, sock, spec.get("rank_vars", ()))
    except BaseException:  # noqa: BLE001 - a worker that cannot be set up says why and leaves
        traceback.print_exc()
        os._exit(1)
    if "store" in request:  # not a worker: the attempt's store (launcher.process.store_host)
        addr, port = request["store"]
        serve_store(fds[2], addr, port)
    run_main(request["argv"])


if __name__ == "__main__":
    main()
