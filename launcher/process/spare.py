"""A warm spare, from its own side: a process forked from the zygote for one local rank that makes
ahead what its worker would make first, then parks until the supervisor hands it that rank's
request (``spares.Spare.take``), or lets it go.

What it makes, under nccl: the CUDA context on its GPU, the caching allocator's first block and
the cuBLAS handle with its workspace (a 64×64 matmul): the one thing a fork cannot carry, and
the slowest a new worker makes (0.31–0.36 s on an H200). Without CUDA it is a worker already
forked and re-parented to the supervisor. It holds no rank, no store connection and no
collective: those are the script's, made after the hand-over.

Messages on its socket (SOCK_SEQPACKET, one JSON object each): it sends ``{"ready": {...}}`` (or
``{"error": "..."}`` and exits); it receives the rank's request (argv, env, cwd) with its stdout and
stderr; it answers ``{"pid": N}`` and becomes the worker, or ``{"error": "..."}`` when the request
is not for it. EOF on the socket (the supervisor let it go) ends it.
"""

import ctypes
import json
import os
import socket
import sys
import time
from typing import List, Optional, Tuple

from worker_lib.core import contract as c

__all__ = ["device_memory_used", "misfit", "park", "warm_cuda", "warn_of_late_cuda_env"]

_MAX_MESSAGE = 1 << 20
_CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # what decides which GPU index k is


def park(sock_fd: int, local_rank: int, cuda: bool) -> Tuple[dict, List[int]]:
    """Warm up, say so, and wait for the rank's request: returns it with its stdio descriptors,
    once answered. Exits when warming up fails or the supervisor lets it go."""
    sock = socket.socket(fileno=sock_fd)
    try:
        made = warm_cuda(local_rank) if cuda else {"device": "cpu", "seconds": 0.0, "gpu_bytes": None}
    except Exception as err:  # noqa: BLE001 - said to the supervisor, which turns spares off
        _answer(sock, {"error": f"{type(err).__name__}: {err}".splitlines()[0]})
        os._exit(1)
    _answer(sock, {"ready": made})
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 2)
    except OSError:
        os._exit(0)
    if not data:  # let go: nothing of it is anyone's
        os._exit(0)
    request = json.loads(data)
    why = misfit(request["env"], local_rank)
    if why:
        _answer(sock, {"error": why})
        os._exit(0)
    _answer(sock, {"pid": os.getpid()})
    sock.close()
    if cuda:
        warn_of_late_cuda_env({name: os.environ.get(name) for name in _CUDA_ENV})
    return request, fds


def warn_of_late_cuda_env(made_with: dict) -> None:
    """Some scripts pick their GPU by setting CUDA_VISIBLE_DEVICES before their first CUDA call;
    in a spare's worker the context was made before the script ran, with ``made_with``, and such
    a setting changes nothing: said once on stderr, where the script's own output goes."""
    original = os._Environ.__setitem__
    said: List[str] = []

    def setitem(environ, key, value):
        original(environ, key, value)
        if key in made_with and value != made_with[key] and not said:
            said.append(key)
            print(
                f"ftlaunch: {key}={value} set by the script changes nothing: this worker's CUDA context "
                f"was made by its warm spare with {key}={made_with[key]}; set it where ftlaunch is "
                "launched, or use --warm-spare off",
                file=sys.stderr,
                flush=True,
            )

    os._Environ.__setitem__ = setitem  # type: ignore[method-assign] # this worker's own os.environ, on purpose


def misfit(env: dict, local_rank: int) -> str:
    """Why a request is not for this spare ('' when it is): another local rank, or another view of
    the GPUs than the one its context was made with."""
    if env.get(c.LOCAL_RANK) != str(local_rank):
        return f"it is local rank {local_rank}'s spare, asked for local rank {env.get(c.LOCAL_RANK)}"
    for name in _CUDA_ENV:
        if env.get(name) != os.environ.get(name):
            return f"it was made with {name}={os.environ.get(name)}, asked for {env.get(name)}"
    return ""


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
    after = device_memory_used(uuid)
    cost = after - before if fresh and before is not None and after is not None else None
    return {"device": str(device), "seconds": time.monotonic() - started, "gpu_bytes": cost}


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
