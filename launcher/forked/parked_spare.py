"""A warm spare, from its own side: a process forked from the zygote for one local rank that makes
ahead what its worker would make first, then parks until the supervisor hands it that rank's
request (``launcher.process.warm_spares.Spare.take``), or lets it go.

What it makes, under nccl: the CUDA context on its GPU, the caching allocator's first block and
the cuBLAS handle with its workspace (a 64×64 matmul): the one thing a fork cannot carry, and
the slowest a new worker makes (0.31–0.36 s on an H200); then NCCL's set-up once per process and
GPU (a group of one on a store of its own, destroyed before it parks: the worker's own group then
takes 0.03 s instead of 0.6–0.65 s on an H100). While parked it maps and registers with CUDA its
rank's memory-tier slots as they appear (``worker_lib.checkpoint.premapped``), so its worker's
restore is one copy per tensor. Without CUDA it is a worker already forked and re-parented to the
supervisor. It holds no rank, no store connection and no collective: those are the script's,
made after the hand-over. Once warm, ps shows it as ``ftlaunch-spare <local rank> ready``.

Messages on its socket (SOCK_SEQPACKET, one JSON object each): it sends ``{"ready": {...}}`` (or
``{"error": "..."}`` and exits); it receives the rank's request (argv, env, cwd) with its stdout and
stderr; it answers ``{"pid": N}`` and becomes the worker, or ``{"error": "..."}`` when the request
is not for it. EOF on the socket (the supervisor let it go) ends it.
"""

import ctypes
import json
import os
import select
import socket
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from launcher.forked.linux import show_as
from launcher.forked.protocol import SPARE_TITLE
from worker_lib.core import contract as c

__all__ = ["device_memory_used", "misfit", "park", "warm_cuda", "warn_of_late_cuda_env"]

_MAX_MESSAGE = 1 << 20
_CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # what decides which GPU index k is
_LOOK_S = 0.5  # a parked spare looks for its rank's memory-tier slots this often


def park(sock_fd: int, local_rank: int, cuda: bool, slots: Optional[dict] = None) -> Tuple[dict, List[int]]:
    """Warm up, say so, and wait for the rank's request: returns it with its stdio descriptors,
    once answered. Exits when warming up fails or the supervisor lets it go. ``slots``: where
    the rank it expects keeps its memory-tier snapshots (``{"folder", "rank"}``), mapped and
    registered with CUDA while it waits, for its worker's load."""
    sock = socket.socket(fileno=sock_fd)
    try:
        made = warm_cuda(local_rank) if cuda else {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}
    except Exception as err:  # noqa: BLE001 - said to the supervisor, which turns spares off
        _answer(sock, {"error": f"{type(err).__name__}: {err}".splitlines()[0]})
        os._exit(1)
    _answer(sock, {"ready": made})
    # What ps shows from now on: a restart takes only a spare that has said it is ready.
    _show(local_rank, "ready")
    nccl_env = _nccl_env(os.environ)
    try:
        data, fds = _wait_for_rank(sock, slots if cuda else None)
    except OSError:
        os._exit(0)
    if not data:  # let go: nothing of it is anyone's
        os._exit(0)
    request = json.loads(data)
    _show(local_rank, "taken")  # until its worker shows itself as the script
    why = misfit(request["env"], local_rank)
    if why:
        _answer(sock, {"error": why})
        os._exit(0)
    if slots is not None and not _same_slots(slots, request["env"]):
        _premapped().forget()  # another rank's: its worker maps its own
    _answer(sock, {"pid": os.getpid()})
    sock.close()
    if cuda:
        warn_of_late_cuda_env({name: os.environ.get(name) for name in _CUDA_ENV}, nccl_env)
    return request, fds


def _wait_for_rank(sock: socket.socket, slots: Optional[dict]) -> Tuple[bytes, List[int]]:
    """The supervisor's message (b"" when it let the spare go); meanwhile, every
    ``_LOOK_S``, the rank's memory-tier slots mapped as they appear (and let go as they change)."""
    while slots is not None and not select.select([sock], [], [], _LOOK_S)[0]:
        try:
            quiet = lambda: not select.select([sock], [], [], 0)[0]  # noqa: E731 - no request yet
            _premapped().look(Path(slots["folder"]), int(slots["rank"]), pin=True, go_on=quiet)
        except Exception as err:  # noqa: BLE001 - a spare that cannot map ahead still serves
            print(f"{SPARE_TITLE}: slots not mapped ahead: {type(err).__name__}: {err}", file=sys.stderr)
            slots = None
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 2)
    return data, fds


def _show(local_rank: int, state: str) -> None:
    show_as(
        SPARE_TITLE,
        [SPARE_TITLE, str(local_rank), state],
        [f"{k}={v}" for k, v in os.environ.items()],
    )


def _same_slots(slots: dict, env: dict) -> bool:
    return env.get(c.FT_MEMORY_DIR) == slots["folder"] and env.get(c.RANK) == str(slots["rank"])


def _premapped():
    from worker_lib.checkpoint import premapped

    return premapped


def warn_of_late_cuda_env(made_with: dict, nccl_env: Optional[dict] = None) -> None:
    """Some scripts pick their GPU by setting CUDA_VISIBLE_DEVICES before their first CUDA call,
    or tune NCCL with NCCL_* variables before making their group; in a spare's worker the context
    was made, and NCCL read its settings, before the script ran, with ``made_with`` and
    ``nccl_env``, and such a setting may change nothing: said once on stderr, where the script's
    own output goes."""
    original = os._Environ.__setitem__
    said: List[str] = []
    nccl_env = nccl_env or {}

    def setitem(environ, key, value):
        original(environ, key, value)
        if said:
            return
        if key in made_with and value != made_with[key]:
            what = (
                "changes nothing: this worker's CUDA context was made by its warm spare with "
                f"{key}={made_with[key]}"
            )
        elif key.startswith("NCCL_") and value != nccl_env.get(key):
            what = "may change nothing: NCCL read its settings when this worker's warm spare set it up"
        else:
            return
        said.append(key)
        print(
            f"ftlaunch: {key}={value} set by the script {what}; set it where ftlaunch is launched, "
            "or use --warm-spare off",
            file=sys.stderr,
            flush=True,
        )

    os._Environ.__setitem__ = setitem  # type: ignore[method-assign] # this worker's own os.environ, on purpose


def misfit(env: dict, local_rank: int) -> str:
    """Why a request is not for this spare ('' when it is): another local rank, or another view of
    the GPUs than the one its context was made with."""
    if env.get(c.LOCAL_RANK) != str(local_rank):
        return f"it is local rank {local_rank}'s spare, asked for local rank {env.get(c.LOCAL_RANK)}"
    for name in _CUDA_ENV + tuple(sorted(set(_nccl_env(env)) | set(_nccl_env(os.environ)))):
        if env.get(name) != os.environ.get(name):
            return f"it was made with {name}={os.environ.get(name)}, asked for {env.get(name)}"
    return ""


def _nccl_env(env) -> dict:
    return {name: value for name, value in env.items() if name.startswith("NCCL_")}


def warm_cuda(local_rank: int) -> dict:
    """Make on GPU ``local_rank`` what its worker would make first. Returns the device, the seconds
    it took and the device memory it took: NVML's count of used memory before and after, or None
    where NVML cannot be read or a context was there before (it would not be counted)."""
    import torch

    started = time.monotonic()
    device = torch.device("cuda", local_rank)
    uuid = str(torch.cuda.get_device_properties(device).uuid)  # no context made for it
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    fresh = has_context is not None and not has_context(local_rank)
    before = device_memory_used(uuid)
    torch.cuda.set_device(device)
    x = torch.ones(64, 64, device=device)
    torch.mm(x, x)  # cuBLAS: its handle and workspace, for this thread (the worker's main thread)
    torch.cuda.synchronize(device)
    del x
    nccl = warm_nccl(device)
    after = device_memory_used(uuid)
    cost = after - before if fresh and before is not None and after is not None else None
    return {"device": str(device), "seconds": time.monotonic() - started, "gpu_bytes": cost, "nccl": nccl}


def warm_nccl(device) -> str:
    """NCCL's set-up once per process and GPU (its kernels loaded onto the device, its settings
    and network read), paid here instead of in the worker's first group: a group of one on a
    store of its own, one all-reduce, destroyed before the spare parks. '' when done, else why
    not (the worker then pays it, as without a spare)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return "torch has no NCCL"
    try:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        try:
            dist.all_reduce(torch.ones(1, device=device))
            torch.cuda.synchronize(device)
        finally:
            dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - a spare without it still saves the context
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return ""


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def device_memory_used(uuid: str) -> Optional[int]:
    """Bytes in use on the GPU of that UUID, every process's, as nvidia-smi counts them (NVML, no
    CUDA context needed); None where NVML cannot say."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        handle, memory = ctypes.c_void_p(), _Memory()
        if nvml.nvmlDeviceGetHandleByUUID(name.encode(), ctypes.byref(handle)) != 0:
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.used)
    finally:
        nvml.nvmlShutdown()


def _answer(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:  # the supervisor is gone or let it go: nothing to answer
        os._exit(0)
