"""The fork server ("zygote"): a process that has already imported torch, ftlaunch's own modules
and the checkpoint storage's filesystem, and forks one worker per rank on request, so a restart
does not pay for a new interpreter importing torch.

Run as ``python -u -m launcher.forked.zygote FD SPEC`` by ``forkserver.ForkServer``; FD is its
end of a SOCK_SEQPACKET socket pair, SPEC a JSON object: the entry point (script or module),
the supervisor's pid, the modules to import.

Each request is one JSON message, a list of jobs (a worker's argv, env, cwd), with each job's
file descriptors (a worker's stdout and stderr pipes); the answer is each job's pid (see
``serve``). A group's workers come in one request: one middle process forks them all, one after
the other, and exits, so each worker is re-parented to the supervisor (a child subreaper), which waits for it
like for any child it spawned. The middle's fork and exit (page tables: with torch's address
space, about 10 ms to fork and 10-20 ms to exit on a 2-core machine) are paid once per request,
not once per rank.
A job with ``"store"`` makes the store host (``store_host``), one with ``"spare"``
a warm spare (``parked_spare``): a worker forked ahead that waits for its rank's request.

Rules the zygote keeps, each because it broke something when it was not kept:
- No thread when it forks (a lock held by another thread stays locked forever in the child):
  no torch op, no process group, no store; OpenBLAS and OpenMP are kept single-threaded here.
- No CUDA: a CUDA context does not survive fork (a spare makes its own, after the fork).
- No code whose import-time state differs per process: the script's own imports run in each
  worker, after the fork, as under torchrun (a library that seeds a generator, reads sys.argv or
  the pid at import would otherwise hand every worker the zygote's). More is imported here only
  when named (``--preload``).
- The collector off while it imports, ``gc.freeze()`` once the imports are done, and on again in
  each worker (as Python's documentation of ``gc.freeze`` advises for a fork server): a collection
  would walk the imports' 480k objects again and again (measured, 0.7-1.4 s of the zygote's
  3.4-5.7 s of CPU), and the children's first collection need not walk (and so copy) every page the
  zygote's objects live in.
"""

import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
import weakref
from typing import Dict, List, Optional, Sequence, Set, Tuple

from launcher.forked.linux import (
    anonymous_pieces,
    collapse_to_huge_pages,
    huge_pages_allowed,
    resident_share,
    set_parent_death_signal,
    show_as,
)
from launcher.forked.parked_spare import park
from launcher.forked.store_host import serve_stores
from launcher.forked.worker_exit import leave, remember_imported

# What every training script imports, directly or lazily at its first DDP step, process group,
# torch.load or worker_lib call (ft.init() imports worker_lib's session and checkpoints, and its
# local rank 0 the node cache's directory code); each one left out is imported again in every
# worker of every restart.
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.nn.parallel",
    "torch._dynamo.utils",
    "torch.utils.serialization",
    "worker_lib",
    "worker_lib.session",
    "worker_lib.checkpoint.manager",
    "worker_lib.checkpoint.directory",
)
# Imported lazily at a worker's first autograd op (torch's profiler hook) and at every fsspec URL
# it resolves (``url_to_fs``): found by listing what a restarted worker still imported after the
# fork. Private modules, absent from some versions: best effort, like the storage's filesystem.
LAZY_PRELOAD = ("torch.profiler._cupti_monitor", "fsspec.implementations.chained")
_MAX_MESSAGE = 1 << 20
_MOST_COLLAPSED = 1 << 30  # to_huge_pages: bytes at most
_RESIDENT_ENOUGH = 7 / 8  # to_huge_pages: a piece at least this much in memory
_REPARENT_WAIT_S = 10.0


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

        random.Random.__init__ = init  # type: ignore[method-assign,assignment] # noted, then undone in __exit__
        return self

    def __exit__(self, *_exc: object) -> None:
        import random

        random.Random.__init__ = self._original  # type: ignore[method-assign]


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

        os._Environ.__getitem__ = getitem  # type: ignore[method-assign] # noted, then undone in __exit__
        return self

    def __exit__(self, *_exc: object) -> None:
        os._Environ.__getitem__ = self._original  # type: ignore[method-assign]


def _cuda_initialized() -> bool:
    """An import that initialized CUDA (a CUDA context does not survive fork), or only its driver:
    `torch.cuda.is_available()` runs cuInit, which torch does not count as initialized, and CUDA
    is unusable in a process forked after it. Asked without initializing either."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized()) or _driver_initialized()


def _driver_initialized() -> bool:
    """cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) until cuInit, and 0 after it; it
    starts nothing. Asked only where libcuda is already loaded (a CUDA torch loads it at import;
    the same question scripts/probe_cuda_imports.py asks, which said 3 after `import torch` on an
    H200)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            if "libcuda.so" not in maps.read():
                return False
        count = ctypes.c_int()
        return ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count)) == 0
    except (OSError, AttributeError):  # no such library or symbol: nothing initialized it
        return False


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


_IN_ZYGOTE = -1  # what fork_jobs returns as the index in the zygote itself
_MAX_FDS = 253  # the most one message can carry (the kernel's SCM_MAX_FD)
_RECORD = struct.Struct("=ii")  # (job index, pid): written whole to a pipe (under PIPE_BUF)


def serve(sock: socket.socket, supervisor: int) -> Optional[Tuple[dict, List[int]]]:
    """Fork the jobs of each request until the supervisor closes its end. A request is
    ``{"jobs": [...], "fds": [n, ...]}``: each job with its own n descriptors, in order; the answer
    is ``{"pids": [pid or null, ...]}`` (null: that job's process died as it started, said in
    ``"error"``), or ``{"error": "..."}`` alone when nothing could be forked. In a forked process
    it returns that job and its descriptors: the worker runs from ``main``, not from inside this
    loop, so the script's exit unwinds nothing of the zygote's."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
        except OSError:
            return None
        if not data:
            return None
        request = json.loads(data)
        index = _IN_ZYGOTE
        answer: Dict[str, object] = {}
        try:
            owned = _split(fds, request["fds"])
            index, pids = fork_jobs(owned, supervisor)
            answer = {"pids": pids}
            if None in pids:
                answer["error"] = "the worker died as it started"
        except Exception as err:  # noqa: BLE001 - reported to the supervisor, which falls back
            answer = {"error": f"{type(err).__name__}: {err}"}
        if index != _IN_ZYGOTE:
            return request["jobs"][index], owned[index]
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(answer).encode())


def to_huge_pages(most: int = _MOST_COLLAPSED) -> int:
    """Back the zygote's memory (about 200 MB: torch's and the preload's) with huge pages, once
    imported: a fork copies a page-table entry per 2 MiB instead of per 4 KiB (on 2 cores a fork
    2 ms instead of 11, a child's exit 4.5 ms instead of 16). Returns the bytes collapsed.

    - Only a 2 MiB piece at least 7/8 in memory: a huge page over memory reserved but hardly
      written would make all of it resident (a sparse 512 MiB preload made 294 MB 807).
    - At most ``most`` bytes (1 GiB): a --preload that holds gigabytes keeps its start short.
    - Not where THP is ``never``; before it says it is ready, not later: a page collapsed after
      a fork is the zygote's own copy (180 MB more in all, measured).
    - A child's first write to a huge page splits it and copies 4 KiB, as before; where the
      kernel cannot collapse (before 6.1, no free huge page), a piece stays as is."""
    if not huge_pages_allowed():
        return 0
    done = 0
    for start, length in anonymous_pieces():
        if done + length > most:
            break
        if resident_share(start, length) >= _RESIDENT_ENOUGH and collapse_to_huge_pages(start, length):
            done += length
    return done


def _split(fds: List[int], counts: List[int]) -> List[List[int]]:
    """Each job's descriptors, from the request's run of them."""
    if sum(counts) != len(fds):  # the kernel cut the message's descriptors short (MSG_CTRUNC)
        raise RuntimeError(f"{len(fds)} descriptors came with a request for {sum(counts)}")
    owned, at = [], 0
    for n in counts:
        owned.append(fds[at : at + n])
        at += n
    return owned


def fork_jobs(owned: List[List[int]], supervisor: int) -> Tuple[int, List[Optional[int]]]:
    """Fork a process per job, each a child of the supervisor: one middle process forks them all,
    one after the other, and exits, so they are re-parented to the supervisor (a child subreaper)
    together. Returns, in the zygote, (``_IN_ZYGOTE``, each job's pid once it leads its own session
    (the supervisor may signal its group at once), None for one that died first); in a forked
    process, (its job's index, []).

    One middle, not several side by side: measured on 2 cores, a second one's fork and exit cost
    more than forking in parallel saved (the jobs already forked want the cores too)."""
    if thread_count() != 1:
        raise RuntimeError(f"{thread_count()} threads in the fork server; forking now could deadlock")
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        return _middle(owned, supervisor, ready_r, ready_w), []
    os.close(ready_w)
    try:
        os.waitpid(middle, 0)
        return _IN_ZYGOTE, _read_pids(ready_r, len(owned))
    finally:
        os.close(ready_r)


def _middle(owned: List[List[int]], supervisor: int, ready_r: int, ready_w: int) -> int:
    """The middle process: forks each job's process and exits. Returns only in a job's process,
    its index."""
    try:
        os.close(ready_r)
        me = os.getpid()  # asked here: in a job's process, getppid() may already be the supervisor
        gone_r, gone_w = os.pipe()  # EOF in each job's process once this one exits
        for index, fds in enumerate(owned):
            if os.fork() == 0:
                os.close(gone_w)
                for later in owned[index + 1 :]:  # the earlier ones' were closed below
                    for fd in later:
                        os.close(fd)
                _detach(supervisor, me, ready_w, index, gone_r)
                return index
            for fd in fds:  # its process has them; a later one must not hold them open
                os.close(fd)
    except BaseException:  # noqa: BLE001 - never back into the zygote's loop
        traceback.print_exc()  # to the fork server's log
        os._exit(1)
    os._exit(0)


def _read_pids(ready_r: int, count: int) -> List[Optional[int]]:
    """Each process writes (its index, its pid) once it leads its session; EOF comes once every
    one wrote or died (None: it died first)."""
    data = b""
    while True:
        chunk = os.read(ready_r, 4096)
        if not chunk:
            break
        data += chunk
    pids: List[Optional[int]] = [None] * count
    for index, pid in _RECORD.iter_unpack(data[: len(data) - len(data) % _RECORD.size]):
        if 0 <= index < count:
            pids[index] = pid
    return pids


def _detach(supervisor: int, middle: int, ready_w: int, index: int, middle_gone: int) -> None:
    """A job's process's first moves: its own session, its pid to the zygote, the supervisor as
    its parent, and death with the supervisor (armed only now: the middle process's exit would
    have fired it)."""
    os.setsid()
    os.write(ready_w, _RECORD.pack(index, os.getpid()))
    os.close(ready_w)
    _wait_for_parent_to_be(supervisor, middle, middle_gone)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != supervisor:  # the supervisor died before the signal was armed
        _leave(f"its parent is pid {os.getppid()}, not the supervisor {supervisor}")


def become_worker(request: dict, fds: List[int], rank_vars: Sequence[str] = ()) -> None:
    """The rank's stdio, environment and working directory, fresh random streams, and what ps
    shows: the script's command line, the rank's variables first in its environment."""
    gc.enable()  # off in the zygote while it imported
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


def _wait_for_parent_to_be(supervisor: int, middle: int, middle_gone: int) -> None:
    """Asleep until the middle process has closed its files as it exits (EOF on ``middle_gone``,
    whose write end only it holds), then a few looks: it is re-parented a moment later."""
    deadline = time.monotonic() + _REPARENT_WAIT_S
    select.select([middle_gone], [], [], _REPARENT_WAIT_S)
    os.close(middle_gone)
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
    main.__file__ = path
    setattr(main, "__cached__", None)  # noqa: B010 - as runpy sets them on a script's __main__
    setattr(main, "__builtins__", builtins)  # noqa: B010
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
    gc.disable()  # on again in each worker (become_worker)
    failed, reads = preload(list(BASE_PRELOAD) + spec.get("preload", []), rank_vars)
    # Best effort: a worker that cannot import its storage's filesystem says why itself.
    reads.update(preload([*LAZY_PRELOAD, *spec.get("storage", [])], rank_vars)[1])
    remember_imported()  # what a worker's exit leaves as it is (worker_exit)
    gc.freeze()
    to_huge_pages()
    ready = {"failed": failed, "reads": reads, "threads": thread_count(), "cuda": _cuda_initialized()}
    sock.send(json.dumps(ready).encode())
    job = serve(sock, spec["supervisor"])
    if job is None:  # the supervisor is done with it
        leave(None)
    sock.close()
    request, fds = job
    try:
        if "spare" in request:  # parked until the supervisor hands it a rank (or lets it go)
            _wire_stdio(fds[:2])  # the fork server's log, until then
            show_as(request["argv"][0], request["argv"], [f"{k}={v}" for k, v in os.environ.items()])
            request, fds = park(fds[2], **request["spare"])
        become_worker(request, fds, rank_vars)
    except BaseException:  # noqa: BLE001 - a worker that cannot be set up says why and leaves
        traceback.print_exc()
        os._exit(1)
    if "store" in request:  # not a worker: the attempts' stores (launcher.forked.store_host)
        serve_stores(fds[2])
    try:
        run_main(request["argv"])
    except SystemExit as done:
        leave(done.code)
    leave(None)


if __name__ == "__main__":
    main()
