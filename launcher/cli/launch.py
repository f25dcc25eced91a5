"""``ftlaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...``: the launch command. It maps the options to
LaunchConfig (``sections.py``), checks them against the world (``preflight.py``), supervises the
run and says its summary; ``main.py`` maps what it raises to exit codes."""

import logging
from typing import Any, Dict, Sequence

import click
from click.core import ParameterSource

from launcher.cli.options import ENV_PREFIX, EPILOG, LAUNCH_OPTIONS, SCRIPT
from launcher.cli.preflight import preflight
from launcher.cli.sections import config_from_options
from launcher.cli.sources import LaunchCommand
from launcher.console import say
from launcher.core.config import LaunchConfig
from launcher.process.signals import SignalInbox

__all__ = ["launch", "options_of"]


@click.command(
    name="ftlaunch",
    cls=LaunchCommand,
    params=[*LAUNCH_OPTIONS, *SCRIPT],
    context_settings={
        "allow_interspersed_args": False,
        "show_default": True,
        "auto_envvar_prefix": ENV_PREFIX,
    },
    epilog=EPILOG,
)
# Only the command line asks for these: a stray FTLAUNCH_VERSION=1 (or --help's variable) would end
# the command before anything starts, and the run would be skipped with exit 0.
@click.version_option(package_name="ftlaunch", allow_from_autoenv=False)
@click.help_option(allow_from_autoenv=False)
@click.pass_obj
def launch(signals: SignalInbox, verbose: bool, **options: Any) -> int:
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
    from launcher.agent.supervise import supervise
    from launcher.cli.summary import summary_lines
    from launcher.observe.exporter import open_exporter

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


def options_of(argv: Sequence[str]) -> Dict[str, Any]:
    """The parameters click parses from a command line (defaults, FTLAUNCH_* and PET_* included):
    what ``config_from_options`` takes, for tools and tests."""
    with launch.make_context("ftlaunch", list(argv)) as context:
        return dict(context.params)
