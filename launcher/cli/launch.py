"""``ftlaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...``: options → LaunchConfig, errors → exit codes.

Every option but --help and --version can also be set as ``FTLAUNCH_<OPTION>``
(``FTLAUNCH_NPROC=8``), and below that as torchrun's ``PET_<OPTION>`` (``launcher.cli.environment``);
the command line wins over both.
"""

import contextlib
import logging
import os
import re
import secrets
import signal
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import click
from click.core import ParameterSource

from launcher.cli.discover import place, resolve_backend, slurm_step, visible_gpu_count
from launcher.cli.environment import torchrun_defaults, torchrun_origins
from launcher.cli.preflight import preflight
from launcher.console import say
from launcher.core.config import (
    ChaosSection,
    ClusterSection,
    EntryKind,
    EntrySection,
    GroupSection,
    HangSection,
    LaunchConfig,
    MetricsSection,
    RunSection,
)
from launcher.core.policy import RestartPolicy
from launcher.grammar.durations import parse_duration
from launcher.grammar.errors import ExitCode, FtlaunchError, UsageError
from launcher.grammar.numbers import decimal, digits, whole_number
from launcher.process.signals import SignalInbox
from worker_lib.core.backend import BACKENDS

__all__ = ["cli", "main"]

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


class _Command(click.Command):
    """``ftlaunch``: an error about a value the environment gave says which variable it was,
    whichever check refused it (click's while it parses, ftlaunch's later)."""

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        with _naming_variables(ctx):
            return super().parse_args(ctx, args)

    def make_parser(self, ctx: click.Context) -> Any:
        """click's parser, whose raw values are checked for emptiness before any is converted
        (a Path makes '.' of '', a fallback ``or`` the default)."""
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def parse_args(args: List[str]) -> Any:
            opts, rest, order = parse(args=args)
            _refuse_empty(opts, self.params)
            return opts, rest, order

        parser.parse_args = parse_args  # type: ignore[method-assign]
        return parser

    def invoke(self, ctx: click.Context) -> Any:
        with _naming_variables(ctx):
            return super().invoke(ctx)


def _refuse_empty(given: Mapping[str, Any], params: Sequence[click.Parameter]) -> None:
    """An option given an empty value on the command line (``--run-id "$ID"`` with ID unset) is
    refused, never taken for its default. An empty variable is unset (click's FTLAUNCH_*, and
    PET_* alike: launcher/cli/environment.py). Options whose default is empty take it."""
    for param in params:
        if (
            isinstance(param, click.Option)
            and param.name
            and given.get(param.name) == ""
            and param.default != ""
        ):
            flag = next(opt for opt in param.opts if opt.startswith("--"))
            raise UsageError(f"{flag} is empty: give it a value, or leave the option out for its default")


@contextlib.contextmanager
def _naming_variables(ctx: click.Context) -> Iterator[None]:
    """The one place that adds where a value came from: click's sources know it for every option."""
    try:
        yield
    except click.ClickException as err:  # its message is final: said again, as main() says it
        told = _variables_named(err.format_message(), ctx)
        if not told:
            raise
        raise UsageError(f"{err.format_message()}{told}") from None
    except UsageError as err:
        err.args = (f"{err}{_variables_named(str(err), ctx)}",)
        raise


def _variables_named(message: str, ctx: click.Context) -> str:
    """' (--node-rank came from PET_NODE_RANK=x)' for the options ``message`` names that the
    environment set; '' for none."""
    told = [
        f"{flags[0]} came from {origin}"
        for flags, origin in _set_by_environment(ctx)
        if any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message) for flag in flags)
    ]
    return f" ({'; '.join(told)})" if told else ""


def _set_by_environment(ctx: click.Context) -> List[Tuple[List[str], str]]:
    """Each option whose value a variable gave (FTLAUNCH_<OPTION>, or torchrun's PET_*): its
    flags, and the variables as they were set."""
    torchrun = torchrun_origins(os.environ, [p.name for p in ctx.command.params if p.name])
    found = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or not param.name:
            continue
        flags = sorted(param.opts, key=lambda flag: not flag.startswith("--"))  # --module before -m
        source = ctx.get_parameter_source(param.name)
        if source is ParameterSource.ENVIRONMENT:
            variable = f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
            found.append((flags, f"{variable}={os.environ.get(variable, '')}"))
        elif source is ParameterSource.DEFAULT_MAP and param.name in torchrun:
            found.append((flags, torchrun[param.name]))
    return found


@click.command(
    cls=_Command,
    context_settings={"allow_interspersed_args": False, "show_default": True},
    epilog="Every option but --help and --version can also be set as FTLAUNCH_<OPTION>, e.g. "
    "FTLAUNCH_NPROC=8, or as torchrun's PET_<OPTION> (PET_NPROC_PER_NODE, PET_NNODES, PET_NODE_RANK, "
    "PET_MASTER_ADDR and PET_MASTER_PORT as the rendezvous endpoint, ...), which the command line and "
    "FTLAUNCH_<OPTION> override.",
)
@click.option(
    "--nproc",
    "--nproc-per-node",
    "nproc",
    default="auto",
    metavar="N|auto|gpu|cpu",
    help="Workers on this node; auto: one per visible GPU, else 1; gpu: one per GPU; cpu: one per CPU.",
)
@click.option("-m", "--module", is_flag=True, help="Run SCRIPT as a module, like python -m.")
@click.option("--no-python", is_flag=True, help="Run SCRIPT as an executable, not with python.")
@click.option(
    "--max-failures",
    type=WHOLE,
    default=3,
    help="Failed groups restarted before giving up; -1: unlimited, 0: none.",
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    help="Collective backend; auto: nccl with GPUs, else gloo.",
)
@click.option(
    "--log-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where per-attempt, per-rank logs go  [default: <run-dir>/<run-name>/logs for a local "
    "run dir, else ftlaunch_logs/<run-name>]",
)
@click.option(
    "--grace-period",
    type=DECIMAL,
    default=5.0,
    help="Seconds between SIGTERM and SIGKILL when stopping workers.",
)
@click.option(
    "--fork-server/--no-fork-server",
    default=True,
    show_default=True,
    help="Fork each worker from a process that has already imported torch and ftlaunch's modules "
    "(and --preload's), instead of starting a new interpreter: restarts in a fraction of the time. The "
    "result of a run does not depend on it.",
)
@click.option(
    "--preload",
    default="",
    metavar="MODULE[,MODULE...]",
    help="Modules the fork server imports too, once for every worker of every attempt (by default it "
    "imports torch, ftlaunch's own modules and the checkpoint storage's; the script's other imports run "
    "in each worker, as under torchrun). Faster restarts, but what such a module does at import is shared "
    "by every worker: random generators it seeds, the sys.argv, pid and environment it sees.",
)
@click.option(
    "--warm-spare",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    help="Keep one process per local rank forked ahead from the fork server, its CUDA context, cuBLAS "
    "handle and NCCL set up on its GPU and its rank's memory-tier slots registered: a restarted rank "
    "starts there. auto: on with nccl (GPUs), else off; on without GPUs: a spare without CUDA.",
)
@click.option(
    "--preempt-signal",
    type=click.Choice(["USR1", "USR2"], case_sensitive=False),
    default="USR1",
    show_default=True,
    help='A signal that means "preempted", like SIGTERM (sbatch --signal=B:USR1@120 sends it ahead '
    "of the time limit): the workers save at one agreed step and ftlaunch exits 143. Workers are "
    "started with it ignored.",
)
@click.option(
    "--run-id", default=None, help="TORCHELASTIC_RUN_ID  [default: <run-name>-<hash of the run's URL>]"
)
@click.option(
    "--master-addr",
    default=None,
    help="Address the workers' store listens on (node 0's)  [default: 127.0.0.1; with many nodes the "
    "--rdzv-endpoint host]",
)
@click.option("--master-port", type=WHOLE, default=0, help="Port of the workers' store; 0: a free one.")
@click.option(
    "--console-ranks",
    default=None,
    metavar="R[,R...]",
    help="Ranks shown on the console (all are logged to files)  [default: all]",
)
@click.option(
    "--checkpoint-dir",
    default=None,
    metavar="URL",
    help="Checkpoint storage for worker_lib (path, gs://, s3://, any fsspec URL); checked before start.",
)
@click.option(
    "--heartbeat-timeout",
    default="auto",
    metavar="auto|off|DURATION",
    help="Longest silence between ft.heartbeat() calls before a rank counts as hung; auto: learned "
    "from the step interval (10x its p99, at least --heartbeat-floor).",
)
@click.option(
    "--init-timeout",
    default="15m",
    metavar="DURATION",
    help="Longest wait for a rank's first heartbeat, and for a checkpoint save/load (90, 90s, 15m, 2h).",
)
@click.option(
    "--heartbeat-floor",
    default="2m",
    metavar="DURATION",
    help="The smallest deadline auto sets: covers steps that are rarely slow (evaluation, logging).",
)
@click.option(
    "--progress-timeout",
    default=None,
    metavar="DURATION",
    help="Longest a rank may beat without a new step (ft.heartbeat(step) with the same step) before it "
    "counts as hung  [default: off: a beat proves only that the rank's thread runs]",
)
@click.option(
    "--run-dir",
    default="ftlaunch_runs",
    metavar="URL",
    help="Where runs live (path or any fsspec URL); <run-dir>/<run-name> holds a run's state, history, "
    "lock and, by default, its checkpoints and logs.",
)
@click.option(
    "--run-name",
    default=None,
    help="Names the run: the same name resumes it  [default: the script's name and a hash of the "
    "command: the same command resumes, other arguments make another run]",
)
@click.option(
    "--fresh", is_flag=True, help="Start the run anew; its previous state and checkpoints are archived."
)
@click.option(
    "--failure-window",
    default=None,
    metavar="DURATION",
    help="Only failures this recent count against --max-failures  [default: all count]",
)
@click.option(
    "--crash-loop",
    type=WHOLE,
    default=3,
    help="Stop early (exit 3) after this many failed attempts in a row known to have made no progress "
    "(no newer commit, no further heartbeat step, or a failure at once); 0: off.",
)
@click.option(
    "--max-preemptions",
    type=WHOLE,
    default=-1,
    help="Preemptions (SIGTERM) a run may be resumed after; they never count as failures. -1: unlimited.",
)
@click.option(
    "--backoff", default="1s", metavar="DURATION", help="Wait before the 2nd restart in a row; doubles."
)
@click.option("--max-backoff", default="1m", metavar="DURATION", help="The longest wait between restarts.")
@click.option(
    "--lease",
    default="60s",
    metavar="DURATION",
    help="How long the run's lock lasts unrenewed (renewed every third of it); after that a supervisor on "
    "another host may take the run over, and this one, finding it lost, stops (exit 4).",
)
@click.option(
    "--storage-timeout",
    default="20s",
    metavar="DURATION",
    help="How long the check that the run dir and checkpoint storage can be written may take.",
)
@click.option(
    "--nnodes",
    default=None,
    metavar="N",
    help="Nodes in the job, one ftlaunch on each, or MIN:MAX: the job runs on as few as MIN and takes "
    "nodes in up to MAX as they come and go  [default: 1; under srun: the step's node count]",
)
@click.option(
    "--node-rank",
    type=WHOLE,
    default=None,
    help="This node's rank; node 0 leads (hosts the stores, holds the run)  [default: 0; under srun: "
    "SLURM_PROCID]",
)
@click.option(
    "--rdzv-endpoint",
    default=None,
    metavar="HOST[:PORT]",
    help="Node 0's address and a free port, where the nodes meet (port 29400 when not given, as torchrun)  "
    "[under srun: the step's first host]",
)
@click.option("--rdzv-id", default=None, help="The rendezvous id  [default: --run-id]")
@click.option(
    "--rdzv-backend", type=click.Choice(["c10d"]), default="c10d", help="torch.distributed.elastic's backend."
)
@click.option(
    "--rdzv-conf",
    default=None,
    metavar="K=V[,K=V...]",
    help="Rendezvous settings, as torchrun's (join_timeout, last_call_timeout, close_timeout, "
    "heartbeat, keep_alive_interval, keep_alive_max_attempt).",
)
@click.option(
    "--join-timeout",
    default="10m",
    metavar="DURATION",
    help="How long the nodes may take to (re)join an attempt before the job stops (exit 5); at most 7 days.",
)
@click.option(
    "--node-timeout",
    default="15s",
    metavar="DURATION",
    help="Silence after which a node's supervisor counts as lost: the others stop their workers and "
    "wait for it to come back. At most 7 days.",
)
@click.option(
    "--chaos",
    default=None,
    metavar="SPEC",
    help="Inject faults into this run to rehearse them, e.g. 'kill:rank=random,every=30s;hang:at=step:500;"
    "seed=7' (kill, segv, hang; at=DURATION|step:N|save, every=, jitter=, rank=, times=; see "
    "docs/reliability.md).",
)
@click.option(
    "--chaos-counts",
    is_flag=True,
    help="Injected failures count against --max-failures (by default they do not).",
)
@click.option(
    "--metrics-port",
    type=WHOLE,
    default=None,
    metavar="PORT",
    help="Serve the run's metrics (Prometheus text: attempts, failures by kind, downtime, goodput, the "
    "step, checkpoints by tier, ...) on this port of --metrics-addr; 0: a free port  [default: none]",
)
@click.option(
    "--metrics-addr", default="127.0.0.1", metavar="ADDR", help="The address --metrics-port listens on."
)
@click.option(
    "--metrics-file",
    type=click.Path(path_type=Path),
    default=None,
    metavar="PATH",
    help="Write the same metrics to PATH (atomically, every few seconds and at the end), for "
    "node_exporter's textfile collector  [default: none]",
)
@click.option("-v", "--verbose", is_flag=True, help="Log the supervisor's own decisions.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
# Only the command line asks for these: a stray FTLAUNCH_VERSION=1 (or --help's variable) would end
# the command before anything starts, and the run would be skipped with exit 0.
@click.version_option(package_name="ftlaunch", allow_from_autoenv=False)
@click.help_option(allow_from_autoenv=False)
@click.pass_obj
def cli(signals: SignalInbox, verbose: bool, **options) -> int:
    """Start SCRIPT on N workers, watch them, and restart the whole group when one fails.

    Everything after SCRIPT is passed to SCRIPT.
    """
    _configure_logging(verbose)
    config = config_from_options(options)  # a value it refuses names its variable itself
    torchrun = _torchrun_banner()
    if torchrun:  # a pod's environment decides how many nodes: say so before anything else can fail
        say(torchrun)
    signals.preempt_signal = config.group.preempt_signal
    preflight(config, signals.raise_if_received)
    signals.raise_if_received()
    from launcher.cli.summary import summary_lines
    from launcher.observe.exporter import open_exporter
    from launcher.supervisor import supervise

    chaos = _chaos_source(config)
    if chaos:  # a forgotten FTLAUNCH_CHAOS must not inject faults unannounced
        say(
            f"{chaos}: injecting {config.chaos.plan} into this run; injected failures "
            f"{'count' if config.restart.count_injected else 'do not count'} against --max-failures"
        )
    with open_exporter(config.metrics, config.run.name, config.cluster.node_rank) as metrics:
        if metrics.port is not None:
            host = f"[{config.metrics.addr}]" if ":" in config.metrics.addr else config.metrics.addr  # IPv6
            say(f"metrics on http://{host}:{metrics.port}/metrics")
        result = supervise(config, signals, say=say, on_events=metrics.watch)
    for line in summary_lines(result):
        say(line)
    if chaos:  # a run that had already succeeded starts no worker: nothing was injected
        nothing = "nothing injected: no worker was started"
        say(f"  {chaos}: " + (f"injected {config.chaos.plan} into this run" if result.attempts else nothing))
    return int(result.exit_code)


def _chaos_source(config: LaunchConfig) -> str:
    """'' without chaos; else 'chaos (where it came from)'."""
    if config.chaos.plan is None:
        return ""
    source = click.get_current_context().get_parameter_source("chaos")
    where = f"{ENV_PREFIX}_CHAOS in the environment" if source is ParameterSource.ENVIRONMENT else "--chaos"
    return f"chaos ({where})"


def _torchrun_banner() -> str:
    """'' unless torchrun's PET_* variables set an option; else which, to what."""
    context = click.get_current_context()
    used = [
        f"--{name.replace('_', '-')} {value}"
        for name, value in (context.default_map or {}).items()
        if context.get_parameter_source(name) is ParameterSource.DEFAULT_MAP
    ]
    return f"from torchrun's PET_* environment: {', '.join(used)}" if used else ""


def _configure_logging(verbose: bool) -> None:
    """Our own warnings reach the console; other libraries' (gcsfs's retries, with tracebacks)
    only with -v: what went wrong is said once, in one line, by the error it ends in."""
    handler = logging.StreamHandler()
    handler.setLevel(logging.DEBUG if verbose else logging.WARNING)
    handler.setFormatter(logging.Formatter("[ftlaunch] %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(lambda record: record.name.split(".")[0] in ("launcher", "worker_lib"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    if not verbose:
        # torch's elastic code logs through a handler of its own (glog-formatted, "W1126 ...
        # dynamic_rendezvous.py ... failed to send a keep-alive heartbeat"): about a node that
        # ftlaunch reports lost itself, in one line.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)


def config_from_options(
    options: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None
) -> LaunchConfig:
    """``options``: the command's parameters as click parsed them (named as declared above);
    what they leave unsaid is derived in ``config.place``."""
    o = options
    if o["module"] and o["no_python"]:
        raise UsageError("--module and --no-python exclude each other")
    gpus = visible_gpu_count()
    procs = _parse_nproc(o["nproc"], gpus)
    kind = EntryKind.MODULE if o["module"] else EntryKind.EXECUTABLE if o["no_python"] else EntryKind.SCRIPT
    entry = EntrySection(o["script"], tuple(o["script_args"]), kind)
    fork_server = o["fork_server"] and kind is not EntryKind.EXECUTABLE
    backend = resolve_backend(o["backend"], procs, gpus)
    at = place(
        entry,
        o["run_dir"],
        run_name=o["run_name"],
        run_id=o["run_id"],
        log_dir=o["log_dir"],
        nnodes=_parse_nnodes(o["nnodes"]) if o["nnodes"] is not None else None,
        node_rank=o["node_rank"],
        rdzv_endpoint=o["rdzv_endpoint"],
        master_addr=o["master_addr"],
        slurm=slurm_step(os.environ if environ is None else environ),
    )
    return LaunchConfig(
        entry=entry,
        group=GroupSection(
            nproc=procs,
            backend=backend,
            log_dir=at.log_dir,
            grace_period=o["grace_period"],
            fork_server=fork_server,
            preload=tuple(name.strip() for name in o["preload"].split(",") if name.strip()),
            warm_spare=_warm_spare(o["warm_spare"], fork_server, backend),
            preempt_signal=int(signal.Signals[f"SIG{o['preempt_signal'].upper()}"]),
            master_addr=at.master_addr,
            master_port=o["master_port"],
            console_ranks=_parse_ranks(o["console_ranks"]),
            checkpoint_url=o["checkpoint_dir"] or f"{at.run_url}/checkpoints",
        ),
        restart=RestartPolicy(
            max_failures=o["max_failures"],
            failure_window=_duration(o, "failure_window", "--failure-window"),
            crash_loop=o["crash_loop"],
            backoff=_seconds(o, "backoff", "--backoff"),
            backoff_cap=_seconds(o, "max_backoff", "--max-backoff"),
            count_injected=o["chaos_counts"],
            max_preemptions=o["max_preemptions"],
        ),
        hangs=HangSection(
            init_timeout=_seconds(o, "init_timeout", "--init-timeout"),
            heartbeat_timeout=_parse_heartbeat_timeout(o["heartbeat_timeout"]),
            heartbeat_floor=_seconds(o, "heartbeat_floor", "--heartbeat-floor"),
            progress_timeout=_duration(o, "progress_timeout", "--progress-timeout"),
        ),
        run=RunSection(
            url=at.run_url,
            name=at.run_name,
            run_id=at.run_id,
            fresh=o["fresh"],
            lease=_seconds(o, "lease", "--lease"),
            storage_timeout=_seconds(o, "storage_timeout", "--storage-timeout"),
        ),
        cluster=ClusterSection(
            nnodes=at.nnodes,
            min_nodes=at.min_nodes,
            node_rank=at.node_rank,
            rdzv_endpoint=at.rdzv_endpoint,
            rdzv_id=o["rdzv_id"] or "",
            rdzv_conf=_parse_rdzv_conf(o["rdzv_conf"]),
            join_timeout=_seconds(o, "join_timeout", "--join-timeout"),
            node_timeout=_seconds(o, "node_timeout", "--node-timeout"),
        ),
        chaos=ChaosSection(_parse_chaos(o["chaos"], at.run_id, at.nnodes) if o["chaos"] else None),
        metrics=MetricsSection(o["metrics_port"], o["metrics_addr"], o["metrics_file"]),
    )


def options_of(argv: Sequence[str]) -> Dict[str, Any]:
    """The parameters click parses from a command line (defaults and FTLAUNCH_* included): what
    ``config_from_options`` takes, for tools and tests."""
    with cli.make_context(
        "ftlaunch", list(argv), auto_envvar_prefix=ENV_PREFIX, default_map=_torchrun_defaults()
    ) as context:
        return dict(context.params)


def _warm_spare(choice: str, fork_server: bool, backend: str) -> bool:
    """auto: on where the ranks have GPUs (nccl) and the fork server can make spares."""
    return choice == "on" or (choice == "auto" and fork_server and backend == "nccl")


def _torchrun_defaults() -> Dict[str, str]:
    """torchrun's PET_* variables, below FTLAUNCH_* and the command line: for the options that
    FTLAUNCH_* may set, not SCRIPT, --version or --help."""
    names = [p.name for p in cli.params if isinstance(p, click.Option) and p.allow_from_autoenv and p.name]
    return torchrun_defaults(os.environ, names)


def _duration(options: Mapping[str, Any], name: str, option: str) -> Optional[float]:
    """An option that may be left unset (None: off)."""
    value = options[name]
    return parse_duration(value, option) if value is not None else None


def _seconds(options: Mapping[str, Any], name: str, option: str) -> float:
    """An option with a default: it always has a value."""
    if options[name] is None:
        raise UsageError(f"{option} needs a duration")
    return parse_duration(options[name], option)


def _parse_chaos(spec: str, run_id: str, nnodes: int):
    """The plan; without seed= a random seed, or on many nodes one every node derives alike."""
    from launcher.grammar.chaos import parse_chaos

    seed = zlib.crc32(run_id.encode()) if nnodes > 1 else secrets.randbelow(2**31)
    return parse_chaos(spec, seed)


def _parse_heartbeat_timeout(value: str) -> Optional[float]:
    if value.strip().lower() == "auto":
        return None
    if value.strip().lower() == "off":
        return 0.0
    return parse_duration(value, "--heartbeat-timeout")


def _parse_nproc(value: str, gpus: int) -> int:
    """A number, or torchrun's words: auto (one per GPU, else 1), gpu, cpu (one per CPU)."""
    if value == "auto":
        return gpus or 1
    if value == "gpu":
        if not gpus:
            raise UsageError("--nproc gpu: this node sees no GPU")
        return gpus
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        return whole_number(value)
    except ValueError:
        raise UsageError(f"--nproc must be a whole number or 'auto' (or gpu, cpu), got {value!r}") from None


def _parse_nnodes(value: str) -> Tuple[int, int]:
    """N (a fixed count: MIN 0) or MIN:MAX (elastic membership)."""
    low, sep, high = value.partition(":")
    try:
        fewest, most = (whole_number(low), whole_number(high)) if sep else (0, whole_number(value))
    except ValueError:
        raise UsageError(f"--nnodes takes N or MIN:MAX (whole numbers), got {value!r}") from None
    if sep and not 1 <= fewest <= most:
        raise UsageError(f"--nnodes {value}: MIN must be at least 1 and at most MAX")
    if sep and fewest == most:  # no room to change: a fixed count
        fewest = 0
    return fewest, most


# The settings torch's c10d rendezvous handler reads (whole seconds or counts).
_RDZV_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)


def _parse_rdzv_conf(value: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    pairs = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        key, sep, setting = item.partition("=")
        key = key.strip()
        if not sep or key not in _RDZV_KEYS or not digits(setting.strip()):
            raise UsageError(
                f"--rdzv-conf takes {', '.join(_RDZV_KEYS)} as KEY=whole number, comma-separated, "
                f"got {item!r}"
            )
        pairs.append((key, setting.strip()))
    return tuple(pairs)


def _parse_ranks(value: Optional[str]) -> Optional[frozenset]:
    if value is None:
        return None
    try:
        return frozenset(whole_number(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--console-ranks takes ranks like 0 or 0,3, got {value!r}") from None


def main(argv: Optional[Sequence[str]] = None, signals: Optional[SignalInbox] = None) -> int:
    """The one place where errors become exit codes. ``signals``: an inbox the caller opened (the
    entry point opens one before it imports anything): SIGINT/SIGTERM/SIGHUP are recorded, never
    raised mid-import or mid-probe, and every stage of a launch acts on them (before start: exit at
    once; later: stop the workers)."""
    args = list(sys.argv[1:] if argv is None else argv)
    inbox = signals or SignalInbox()
    try:
        if args[:1] == ["status"] and not Path("status").exists():  # `ftlaunch status`, not a script
            from launcher.cli.status import status_cli

            inbox.close()  # a command that only reads: Ctrl+C simply ends it
            inbox.raise_if_received()
            return status_cli.main(args=args[1:], prog_name="ftlaunch status", standalone_mode=False)
        if not inbox.is_open:
            inbox.open()
        return cli.main(
            args=args,
            prog_name="ftlaunch",
            standalone_mode=False,
            auto_envvar_prefix=ENV_PREFIX,
            default_map=_torchrun_defaults(),
            obj=inbox,
        )
    except click.exceptions.Exit as done:  # --help, --version
        return done.exit_code
    except click.ClickException as err:
        _error(err.format_message())
        return ExitCode.USAGE
    except FtlaunchError as err:
        _error(str(err))
        return err.exit_code
    except (KeyboardInterrupt, click.exceptions.Abort):  # Ctrl+C before the handlers were in place
        return ExitCode.INTERRUPTED_SIGINT
    finally:
        if signals is None:
            inbox.close()


def _error(message: str) -> None:
    click.echo(f"ftlaunch: error: {message}", err=True)
