"""``ftlaunch``'s options as click declares them, in --help's order: the one list that --help,
``sections.py`` (values -> LaunchConfig's sections) and docs/reference.md's test read.

Every option but --help and --version can also be set as ``FTLAUNCH_<OPTION>``
(``FTLAUNCH_NPROC=8``), and below that as torchrun's ``PET_<OPTION>`` (``environment.py``); the
command line wins over both.
"""

from pathlib import Path
from typing import Any, Callable, Optional, Tuple, Union

import click

from launcher.grammar.numbers import decimal, whole_number
from worker_lib.core.backend import BACKENDS

__all__ = ["ENV_PREFIX", "EPILOG", "LAUNCH_OPTIONS", "SCRIPT"]

ENV_PREFIX = "FTLAUNCH"


class _Number(click.ParamType):
    """click's INT and FLOAT take other scripts' digits ("２") and underscores: these do not."""

    def __init__(self, name: str, parse: Callable[[str], Union[int, float]], words: str) -> None:
        self.name, self._parse, self._words = name, parse, words

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value  # a default
        try:
            return self._parse(str(value))
        except ValueError:
            self.fail(f"{value!r} is not {self._words}", param, ctx)


WHOLE = _Number("integer", whole_number, "a whole number")
DECIMAL = _Number("float", decimal, "a number")

EPILOG = (
    "Every option but --help and --version can also be set as FTLAUNCH_<OPTION>, e.g. "
    "FTLAUNCH_NPROC=8, or as torchrun's PET_<OPTION> (PET_NPROC_PER_NODE, PET_NNODES, PET_NODE_RANK, "
    "PET_MASTER_ADDR and PET_MASTER_PORT as the rendezvous endpoint, ...), which the command line and "
    "FTLAUNCH_<OPTION> override."
)

LAUNCH_OPTIONS: Tuple[click.Option, ...] = (
    click.Option(
        ["--nproc", "--nproc-per-node", "nproc"],
        default="auto",
        metavar="N|auto|gpu|cpu",
        help="Workers on this node; auto: one per visible GPU, else 1; gpu: one per GPU; cpu: one per CPU.",
    ),
    click.Option(
        ["-m", "--module"],
        is_flag=True,
        help="Run SCRIPT as a module, like python -m.",
    ),
    click.Option(
        ["--no-python"],
        is_flag=True,
        help="Run SCRIPT as an executable, not with python.",
    ),
    click.Option(
        ["--max-failures"],
        type=WHOLE,
        default=3,
        help="Failed groups restarted before giving up; -1: unlimited, 0: none.",
    ),
    click.Option(
        ["--backend"],
        type=click.Choice(BACKENDS),
        default="auto",
        help="Collective backend; auto: nccl with GPUs, else gloo.",
    ),
    click.Option(
        ["--log-dir"],
        type=click.Path(path_type=Path),
        default=None,
        help="Where per-attempt, per-rank logs go  [default: <run-dir>/<run-name>/logs for a local "
        "run dir, else ftlaunch_logs/<run-name>]",
    ),
    click.Option(
        ["--grace-period"],
        type=DECIMAL,
        default=5.0,
        help="Seconds between SIGTERM and SIGKILL when stopping workers.",
    ),
    click.Option(
        ["--fork-server/--no-fork-server"],
        default=True,
        show_default=True,
        help="Fork each worker from a process that has already imported torch and ftlaunch's modules "
        "(and --preload's), instead of starting a new interpreter: restarts in a fraction of the time. The "
        "result of a run does not depend on it.",
    ),
    click.Option(
        ["--preload"],
        default="",
        metavar="MODULE[,MODULE...]",
        help="Modules the fork server imports too, once for every worker of every attempt (by default it "
        "imports torch, ftlaunch's own modules and the checkpoint storage's; the script's other imports run "
        "in each worker, as under torchrun). Faster restarts, but what such a module does at import is "
        "shared by every worker: random generators it seeds, the sys.argv, pid and environment it sees.",
    ),
    click.Option(
        ["--warm-spare"],
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        help="Keep one process per local rank forked ahead from the fork server, its CUDA context, cuBLAS "
        "handle and NCCL set up on its GPU and its rank's memory-tier slots registered: a restarted rank "
        "starts there. auto: on with nccl (GPUs), else off; on without GPUs: a spare without CUDA.",
    ),
    click.Option(
        ["--preempt-signal"],
        type=click.Choice(["USR1", "USR2"], case_sensitive=False),
        default="USR1",
        show_default=True,
        help='A signal that means "preempted", like SIGTERM (sbatch --signal=B:USR1@120 sends it ahead '
        "of the time limit): the workers save at one agreed step and ftlaunch exits 143. Workers are "
        "started with it ignored.",
    ),
    click.Option(
        ["--run-id"],
        default=None,
        help="TORCHELASTIC_RUN_ID  [default: <run-name>-<hash of the run's URL>]",
    ),
    click.Option(
        ["--master-addr"],
        default=None,
        help="Address the workers' store listens on (node 0's)  [default: 127.0.0.1; with many nodes the "
        "--rdzv-endpoint host]",
    ),
    click.Option(
        ["--master-port"],
        type=WHOLE,
        default=0,
        help="Port of the workers' store; 0: a free one.",
    ),
    click.Option(
        ["--console-ranks"],
        default=None,
        metavar="R[,R...]",
        help="Ranks shown on the console (all are logged to files)  [default: all]",
    ),
    click.Option(
        ["--checkpoint-dir"],
        default=None,
        metavar="URL",
        help="Checkpoint storage for worker_lib (path, gs://, s3://, any fsspec URL); checked before start.",
    ),
    click.Option(
        ["--heartbeat-timeout"],
        default="auto",
        metavar="auto|off|DURATION",
        help="Longest silence between ft.heartbeat() calls before a rank counts as hung; auto: learned "
        "from the step interval (10x its p99, at least --heartbeat-floor).",
    ),
    click.Option(
        ["--init-timeout"],
        default="15m",
        metavar="DURATION",
        help="Longest wait for a rank's first heartbeat, and for a checkpoint save/load (90, 90s, 15m, 2h).",
    ),
    click.Option(
        ["--heartbeat-floor"],
        default="2m",
        metavar="DURATION",
        help="The smallest deadline auto sets: covers steps that are rarely slow (evaluation, logging).",
    ),
    click.Option(
        ["--progress-timeout"],
        default=None,
        metavar="DURATION",
        help="Longest a rank may beat without a new step (ft.heartbeat(step) with the same step) before it "
        "counts as hung  [default: off: a beat proves only that the rank's thread runs]",
    ),
    click.Option(
        ["--straggler-factor"],
        default="1.5",
        metavar="F|off",
        help="A rank whose own work (its step without the wait for the others, read from torch's flight "
        "recorder) is F times the median of the other ranks' over --straggler-window is named slow.",
    ),
    click.Option(
        ["--straggler-window"],
        default="30s",
        metavar="DURATION",
        help="How long each rank's own work is averaged over before it is compared.",
    ),
    click.Option(
        ["--run-dir"],
        default="ftlaunch_runs",
        metavar="URL",
        help="Where runs live (path or any fsspec URL); <run-dir>/<run-name> holds a run's state, history, "
        "lock and, by default, its checkpoints and logs.",
    ),
    click.Option(
        ["--run-name"],
        default=None,
        help="Names the run: the same name resumes it  [default: the script's name and a hash of the "
        "command: the same command resumes, other arguments make another run]",
    ),
    click.Option(
        ["--fresh"],
        is_flag=True,
        help="Start the run anew; its previous state and checkpoints are archived.",
    ),
    click.Option(
        ["--failure-window"],
        default=None,
        metavar="DURATION",
        help="Only failures this recent count against --max-failures  [default: all count]",
    ),
    click.Option(
        ["--crash-loop"],
        type=WHOLE,
        default=3,
        help="Stop early (exit 3) after this many failed attempts in a row known to have made no progress "
        "(no newer commit, no further heartbeat step, or a failure at once); 0: off.",
    ),
    click.Option(
        ["--max-preemptions"],
        type=WHOLE,
        default=-1,
        help="Preemptions (SIGTERM) a run may be resumed after; they never count as failures. -1: unlimited.",
    ),
    click.Option(
        ["--backoff"],
        default="1s",
        metavar="DURATION",
        help="Wait before the 2nd restart in a row; doubles.",
    ),
    click.Option(
        ["--max-backoff"],
        default="1m",
        metavar="DURATION",
        help="The longest wait between restarts.",
    ),
    click.Option(
        ["--lease"],
        default="60s",
        metavar="DURATION",
        help="How long the run's lock lasts unrenewed (renewed every third of it); after that a supervisor "
        "on another host may take the run over, and this one, finding it lost, stops (exit 4).",
    ),
    click.Option(
        ["--storage-timeout"],
        default="20s",
        metavar="DURATION",
        help="How long the check that the run dir and checkpoint storage can be written may take.",
    ),
    click.Option(
        ["--nnodes"],
        default=None,
        metavar="N",
        help="Nodes in the job, one ftlaunch on each, or MIN:MAX: the job runs on as few as MIN and takes "
        "nodes in up to MAX as they come and go  [default: 1; under srun: the step's node count]",
    ),
    click.Option(
        ["--standby-nodes"],
        type=WHOLE,
        default=0,
        metavar="K",
        help="Nodes beyond --nnodes that join and stand by, warm, running no rank: one takes a lost "
        "node's place (its GROUP_RANK and RANKs) at once, not counted as a failure. Node ranks run to "
        "N+K-1; node 0 always trains  [under srun: --nnodes defaults to the step's nodes minus K]",
    ),
    click.Option(
        ["--exclude-after"],
        type=WHOLE,
        default=None,
        metavar="K",
        help="With standby nodes: a node that is the root cause of K failures within --failure-window "
        "(blamed surely) leaves the job, exit 8, and a standby takes its place; the failures still "
        "count. 0: never  [default: 2 with --standby-nodes, else 0]",
    ),
    click.Option(
        ["--node-rank"],
        type=WHOLE,
        default=None,
        help="This node's rank; node 0 leads (hosts the stores, holds the run)  [default: 0; under srun: "
        "SLURM_PROCID]",
    ),
    click.Option(
        ["--rdzv-endpoint"],
        default=None,
        metavar="HOST[:PORT]",
        help="Node 0's address and a free port, where the nodes meet (port 29400 when not given, as "
        "torchrun)  [under srun: the step's first host]",
    ),
    click.Option(
        ["--rdzv-id"],
        default=None,
        help="The rendezvous id  [default: --run-id]",
    ),
    click.Option(
        ["--rdzv-backend"],
        type=click.Choice(["c10d"]),
        default="c10d",
        help="torch.distributed.elastic's backend.",
    ),
    click.Option(
        ["--rdzv-conf"],
        default=None,
        metavar="K=V[,K=V...]",
        help="Rendezvous settings, as torchrun's (join_timeout, last_call_timeout, close_timeout, "
        "heartbeat, keep_alive_interval, keep_alive_max_attempt).",
    ),
    click.Option(
        ["--join-timeout"],
        default="10m",
        metavar="DURATION",
        help="How long the nodes may take to (re)join an attempt before the job stops (exit 5); at most 7 "
        "days.",
    ),
    click.Option(
        ["--node-timeout"],
        default="15s",
        metavar="DURATION",
        help="Silence after which a node's supervisor counts as lost: the others stop their workers and "
        "wait for it to come back. At most 7 days.",
    ),
    click.Option(
        ["--health-check"],
        default=None,
        metavar="CMD",
        help="A command (run by /bin/sh -c) that must exit 0 on this node before it joins and before each "
        "restart, beside the built-in checks; it gets FTLAUNCH_NODE_RANK and the ranks' GPUs. A node that "
        "fails exits 8  [default: none]",
    ),
    click.Option(
        ["--health-check-timeout"],
        default="60s",
        metavar="DURATION",
        help="How long --health-check may take before it is killed (a failure).",
    ),
    click.Option(
        ["--memory-peers"],
        type=WHOLE,
        default=1,
        metavar="R",
        help='With many nodes: each node\'s newest memory snapshots (ft.save_checkpoint(to="memory")) are '
        "copied to R other nodes, so a node lost with its memory costs a step, not the storage interval. "
        "0: no copies",
    ),
    click.Option(
        ["--memory-copy-rate"],
        default="1GB",
        metavar="BYTES",
        help="The most bytes a second a node sends for those copies (500MB, 2GiB; 0: no cap), so they never "
        "starve the job's own network.",
    ),
    click.Option(
        ["--chaos"],
        default=None,
        metavar="SPEC",
        help="Inject faults into this run to rehearse them, e.g. "
        "'kill:rank=random,every=30s;hang:at=step:500;seed=7' (kill, segv, hang, raise, sleep; "
        "at=DURATION|step:N|save|commit, every=, jitter=, rank=, times=; with many nodes "
        "kill-node:node=N,at=... and bad-node:node=N,at=...; see docs/chaos.md).",
    ),
    click.Option(
        ["--chaos-counts"],
        is_flag=True,
        help="Injected failures count against --max-failures (by default they do not).",
    ),
    click.Option(
        ["--metrics-port"],
        type=WHOLE,
        default=None,
        metavar="PORT",
        help="Serve the run's metrics (Prometheus text: attempts, failures by kind, downtime, goodput, the "
        "step, checkpoints by tier, ...) on this port of --metrics-addr; 0: a free port  [default: none]",
    ),
    click.Option(
        ["--metrics-addr"],
        default="127.0.0.1",
        metavar="ADDR",
        help="The address --metrics-port listens on.",
    ),
    click.Option(
        ["--metrics-file"],
        type=click.Path(path_type=Path),
        default=None,
        metavar="PATH",
        help="Write the same metrics to PATH (atomically, every few seconds and at the end), for "
        "node_exporter's textfile collector  [default: none]",
    ),
    click.Option(
        ["-v", "--verbose"],
        is_flag=True,
        help="Log the supervisor's own decisions.",
    ),
)

# SCRIPT and everything after it, which belongs to SCRIPT.
SCRIPT: Tuple[click.Argument, ...] = (
    click.Argument(["script"]),
    click.Argument(["script_args"], nargs=-1, type=click.UNPROCESSED),
)
