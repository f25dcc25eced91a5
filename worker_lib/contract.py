"""The environment contract between the ftlaunch supervisor and its workers.

Both packages import the names from here, so a variable is spelled in exactly one place.
The torchrun variables keep torchrun's meaning: a script that runs under torchrun runs
under ftlaunch unchanged. This module must stay free of heavy imports (no torch): workers
import it for heartbeats alone.
"""

__all__ = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RESTART_COUNT",
    "MAX_RESTARTS",
    "RUN_ID",
    "USE_AGENT_STORE",
    "ERROR_FILE",
    "NCCL_ASYNC_ERROR_HANDLING",
    "FT_ATTEMPT",
    "FT_BACKEND",
    "FT_CHECKPOINT_URL",
    "TORCHRUN_VARIABLES",
]

# torchrun's variables (torch/distributed/elastic/agent/server/local_elastic_agent.py).
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID = "TORCHELASTIC_RUN_ID"
# "True": the supervisor hosts the TCPStore at MASTER_ADDR:MASTER_PORT and every rank,
# rank 0 included, connects to it as a client (torch.distributed's env:// init reads it).
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
# Where torch.distributed.elastic's @record writes an uncaught exception as JSON.
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

TORCHRUN_VARIABLES = (
    RANK,
    LOCAL_RANK,
    WORLD_SIZE,
    LOCAL_WORLD_SIZE,
    GROUP_RANK,
    GROUP_WORLD_SIZE,
    ROLE_RANK,
    ROLE_NAME,
    ROLE_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    RESTART_COUNT,
    MAX_RESTARTS,
    RUN_ID,
    USE_AGENT_STORE,
    ERROR_FILE,
)

# ftlaunch's own.
FT_ATTEMPT = "FTLAUNCH_ATTEMPT"  # 0 for the first group of a run, +1 per restart
FT_BACKEND = "FTLAUNCH_BACKEND"  # "nccl" or "gloo", chosen once by the supervisor
FT_CHECKPOINT_URL = "FTLAUNCH_CHECKPOINT_URL"  # fsspec URL of the checkpoint root (--checkpoint-dir)
