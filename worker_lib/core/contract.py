"""The environment contract between the ftlaunch supervisor and its workers.

Both sides import the names from here (one spelling); torchrun's keep torchrun's meaning. No
heavy imports: workers import it for heartbeats alone.
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
    "FT_NODE_RANK",
    "FT_BACKEND",
    "FT_CHECKPOINT_URL",
    "FT_HEARTBEAT_FILE",
    "FT_CHAOS",
    "SLOT_WORDS",
    "SLOT_BEATS",
    "SLOT_STEP",
    "SLOT_TIME_NS",
    "SLOT_PAUSED",
    "SLOT_PAUSES",
    "SLOT_DUMP_SIGNAL",
    "SLOT_MAIN_THREAD",
    "SLOT_PID",
    "SLOT_LOADED_NS",
    "SLOT_STOP_AWARE",
    "SLOT_STOP_AT_STEP",
    "SLOT_CHAOS",
    "SLOT_LOADED_TIER",
    "SLOT_LOADED_STEP",
    "SLOT_SAVES_MEMORY",
    "SLOT_SAVE_MEMORY_NS",
    "SLOT_SAVES_STORAGE",
    "SLOT_SAVE_STORAGE_NS",
    "SLOT_COMMITS",
    "SLOT_COMMIT_NS",
    "SLOT_LOAD_NS",
    "SLOT_OWN_NS",
    "SLOT_OWN_STEP_NS",
    "SLOT_OWN_STEPS",
    "SLOT_COLLECTIVE_SEQ",
    "SLOT_COLLECTIVE_KIND",
    "SLOT_COLLECTIVE_READS",
    "SLOT_COLLECTIVE_SAME",
    "COLLECTIVE_KINDS",
    "FR_BUFFER_SIZE",
    "LOADED_NONE",
    "LOADED_STORAGE",
    "LOADED_MEMORY",
    "LOADED_PEER",
    "TIER_NAMES",
    "FT_MEMORY_DIR",
    "CHAOS_AT_BEAT",
    "CHAOS_AT_SAVE",
    "CHAOS_AT_COMMIT",
    "CHAOS_RAISE",
    "CHAOS_SLEEP",
    "CHAOS_SLOW",
    "CHAOS_FACTOR_SHIFT",
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

# ftlaunch's own.
FT_NODE_RANK = "FTLAUNCH_NODE_RANK"  # the node's rank, in --health-check's environment (not the ranks')
FT_ATTEMPT = "FTLAUNCH_ATTEMPT"  # 0 for the first group of a run, +1 per restart
FT_BACKEND = "FTLAUNCH_BACKEND"  # "nccl" or "gloo", chosen once by the supervisor
FT_CHECKPOINT_URL = "FTLAUNCH_CHECKPOINT_URL"  # fsspec URL of the checkpoint root (--checkpoint-dir)
# The node's memory tier: the supervisor's folder in /dev/shm; unset: none.
FT_MEMORY_DIR = "FTLAUNCH_MEMORY_DIR"
# Shared-memory file of heartbeat slots, one per LOCAL_RANK; absent: a private page nobody reads.
FT_HEARTBEAT_FILE = "FTLAUNCH_HEARTBEAT_FILE"
# torch's flight recorder (gloo's and NCCL's collectives), which the own-work thread reads; the
# supervisor sets it for its workers unless the user has.
FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
# "1" under --chaos: ft.heartbeat() also reads requests in SLOT_CHAOS.
FT_CHAOS = "FTLAUNCH_CHAOS_REQUESTS"

# A slot is SLOT_WORDS native int64 words (256 bytes: four cache lines per rank). Each word has
# one writer: the worker, except SLOT_STOP_AT_STEP, written by the supervisor. Aligned 8-byte
# stores are atomic, so a read may be stale by a beat but never torn.
SLOT_WORDS = 32
SLOT_BEATS = 0  # ft.heartbeat() calls so far in this process
SLOT_STEP = 1  # the step passed to the last beat (-1: none given)
SLOT_TIME_NS = 2  # CLOCK_MONOTONIC ns of the last beat, pause start or pause end
SLOT_PAUSED = 3  # > 0 while inside a save, a load, init() or pause_heartbeat()
SLOT_PAUSES = 4  # pauses ended so far (tells the supervisor an interval contained one)
SLOT_DUMP_SIGNAL = 5  # the signal that makes this worker write its stacks to stderr; 0: none
SLOT_MAIN_THREAD = 6  # threading.main_thread().ident, to find its stack in the dump
SLOT_PID = 7  # the process that attached to the slot
SLOT_LOADED_NS = 8  # CLOCK_MONOTONIC ns when ft.load_checkpoint() (or latest_checkpoint_dir) returned
SLOT_STOP_AWARE = 9  # 1 once the worker has called ft.should_stop(): it can stop cleanly when asked
# The one word the supervisor writes: when asked to stop (Ctrl+C, SIGTERM), the step from which
# ft.should_stop(step) is true on every rank; 0: not asked.
SLOT_STOP_AT_STEP = 10
# The second word the supervisor writes: a --chaos request for worker_lib to carry out, as
# (sequence << 16) | (point << 8) | action; a new sequence number is a new request.
SLOT_CHAOS = 11
# What ft.load_checkpoint() loaded: the tier (LOADED_NONE: nothing, a fresh start) and the step
# (meaningful only with a tier).
SLOT_LOADED_TIER = 12
SLOT_LOADED_STEP = 13
LOADED_NONE, LOADED_STORAGE, LOADED_MEMORY = 0, 1, 2
LOADED_PEER = 3  # the node's memory tier, from another node's copy (its record names it: "origin")
TIER_NAMES = {LOADED_STORAGE: "storage", LOADED_MEMORY: "memory", LOADED_PEER: "another node's copy"}
# worker_lib's checkpoint counters for the metrics, cumulative in this process (counts and ns).
SLOT_SAVES_MEMORY = 14
SLOT_SAVE_MEMORY_NS = 15
SLOT_SAVES_STORAGE = 16
SLOT_SAVE_STORAGE_NS = 17
SLOT_COMMITS = 18  # written by the background save thread, the others by the training thread
SLOT_COMMIT_NS = 19
SLOT_LOAD_NS = 20
# Each rank's own work (worker_lib.core.own_work's thread, their one writer), cumulative: the ns
# from each measured step's start to the last collective the rank entered in it, the measured
# steps' whole ns, and how many steps were measured. The straggler report compares ranks by it.
SLOT_OWN_NS = 21
SLOT_OWN_STEP_NS = 22
SLOT_OWN_STEPS = 23
# The last collective this rank entered in the default process group, as the same thread last read
# the flight recorder: its sequence number (0: none yet), its kind (an index in COLLECTIVE_KINDS),
# and how many reads there were (0: never read: unknown, not "none"). A hang's culprit is the
# rank that never entered the collective the others wait in.
SLOT_COLLECTIVE_SEQ = 24
SLOT_COLLECTIVE_KIND = 25
SLOT_COLLECTIVE_READS = 26
# Reads in a row that found the same last collective: 1 or more, it has not moved for a read's
# period (2 s): settled evidence, where a rank just entered may not yet show (a hang's is settled).
SLOT_COLLECTIVE_SAME = 27
# 28..31: spare, zero
COLLECTIVE_KINDS = (
    "other",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "send",
    "recv",
    "allgather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
    "_allgather_base",
    "_reduce_scatter_base",
)

# Where a --chaos request is carried out, and what it does (a signal number, or one of these).
CHAOS_AT_BEAT = 0  # in the training thread, at the next ft.heartbeat()
CHAOS_AT_SAVE = 1  # half-way through writing this rank's part of the next save
CHAOS_AT_COMMIT = 2  # once this rank's part is written, before the step can be committed
CHAOS_RAISE = 200  # an exception in the training thread
CHAOS_SLEEP = 201  # the training thread sleeps for good: a hang of a live process
CHAOS_SLOW = 202  # from now on each step takes the factor times as long (a straggler)
# slow's factor, in hundredths, above the sequence number in the word
CHAOS_FACTOR_SHIFT = 48
