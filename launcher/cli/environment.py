"""torchrun's environment, as Kubernetes' operators set it for the launcher.

torchrun reads every option it is not given from ``PET_<OPTION>``
(torch/distributed/argparse_util.py), and the operators configure it that way: Kubeflow's
Trainer sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT``; a PyTorchJob's elastic policy ``PET_RDZV_ENDPOINT``, ``PET_RDZV_BACKEND``,
``PET_MAX_RESTARTS`` and more. So ftlaunch reads them too, below ``FTLAUNCH_<OPTION>`` and the
command line: every option of its own as ``PET_<OPTION>``, torchrun's names for the same things
mapped to ours, and, as torchrun's static rendezvous does, ``PET_MASTER_ADDR:PET_MASTER_PORT``
as where the nodes meet when no rendezvous endpoint is given. What they become is click's
``default_map``, which click ranks below the command line and the ``FTLAUNCH_`` variables.
"""

import logging
from typing import Dict, Iterable, Mapping, Tuple

from launcher.grammar.errors import UsageError

__all__ = ["PET_PREFIX", "torchrun_defaults", "torchrun_origins"]

log = logging.getLogger(__name__)

PET_PREFIX = "PET_"

# torchrun's names for options ftlaunch has under another name, and what they mean here.
_RENAMED = {
    "NPROC_PER_NODE": "nproc",  # N, auto, gpu or cpu, as torchrun takes them
    "MAX_RESTARTS": "max_failures",  # failed groups restarted before giving up: the same count
}
# Where torchrun's static rendezvous meets: for ftlaunch, the rendezvous endpoint (node 0 hosts
# the job's store there). Not ftlaunch's --master-addr/--master-port, which place the workers'
# store: on node 0 beside the job's store, on a port of its own each attempt.
_MASTER = ("MASTER_ADDR", "MASTER_PORT")
# torchrun's rendezvous backends: ftlaunch always meets through torch's c10d handler, with node
# ranks fixed as a static rendezvous fixes them.
_BACKENDS = {"c10d": "c10d", "static": "c10d"}
# torchrun options that ftlaunch does its own way, read and left alone: an operator's full set of
# variables must not be an error. STANDALONE (one node, a local rendezvous) is ftlaunch's one node.
_TORCHRUN_ONLY = (
    "STANDALONE",
    "MONITOR_INTERVAL",
    "START_METHOD",
    "ROLE",
    "REDIRECTS",
    "TEE",
    "LOCAL_RANKS_FILTER",
    "LOCAL_ADDR",
    "LOGS_SPECS",
    "LOG_LINE_PREFIX_TEMPLATE",
    "RUN_PATH",
)


def torchrun_defaults(environ: Mapping[str, str], options: Iterable[str]) -> Dict[str, str]:
    """What ``PET_*`` says for each of ``options`` (click's parameter names), as a default_map."""
    found = {name: value for name, (value, _) in _read(environ, options).items()}
    if "rdzv_backend" in found:
        found["rdzv_backend"] = _backend(found["rdzv_backend"])
    ignored = sorted(
        k for k in environ if k.startswith(PET_PREFIX) and k[len(PET_PREFIX) :] in _TORCHRUN_ONLY
    )
    if ignored:
        log.info("torchrun's %s: nothing to do for ftlaunch", ", ".join(ignored))
    return found


def torchrun_origins(environ: Mapping[str, str], options: Iterable[str]) -> Dict[str, str]:
    """Which variables gave each option its ``torchrun_defaults`` value, as a person would set them
    (``PET_MAX_RESTARTS=abc``): for an error about that value."""
    return {name: origin for name, (_, origin) in _read(environ, options).items()}


def _read(environ: Mapping[str, str], options: Iterable[str]) -> Dict[str, Tuple[str, str]]:
    """Each option's value from ``PET_*`` and the variables it came from. An empty variable is
    unset, as click takes an empty ``FTLAUNCH_*`` (``PET_RUN_DIR=`` was the current folder)."""
    found: Dict[str, Tuple[str, str]] = {}
    for torchrun_name, ours in _RENAMED.items():
        key = PET_PREFIX + torchrun_name
        if environ.get(key):
            found[ours] = (environ[key], f"{key}={environ[key]}")
    for name in options:  # ftlaunch's own name wins over torchrun's for the same option
        key = PET_PREFIX + name.upper()
        if environ.get(key) and name.upper() not in _MASTER:
            found[name] = (environ[key], f"{key}={environ[key]}")
    addr, port = (PET_PREFIX + name for name in _MASTER)
    if "rdzv_endpoint" not in found and environ.get(addr) and environ.get(port):
        endpoint = f"{environ[addr]}:{environ[port]}"
        found["rdzv_endpoint"] = (endpoint, f"{addr}={environ[addr]} and {port}={environ[port]}")
    return found


def _backend(value: str) -> str:
    try:
        return _BACKENDS[value.strip().lower()]
    except KeyError:
        raise UsageError(
            f"{PET_PREFIX}RDZV_BACKEND={value}: ftlaunch meets through torch's c10d rendezvous "
            f"({', '.join(sorted(_BACKENDS))} are taken)"
        ) from None
