"""Where the launch's values come from: the command line, ``FTLAUNCH_<OPTION>`` (click's own) and
torchrun's ``PET_<OPTION>`` (``environment.py``, as click's default_map). An error about a value
the environment gave names the variable; an empty value on the command line is refused."""

import contextlib
import os
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import click
from click.core import ParameterSource

from launcher.cli.environment import torchrun_defaults, torchrun_origins
from launcher.grammar.errors import UsageError

__all__ = ["LaunchCommand"]


class LaunchCommand(click.Command):
    """``ftlaunch``: an error about a value the environment gave says which variable it was,
    whichever check refused it (click's while it parses, ftlaunch's later)."""

    def make_context(
        self,
        info_name: Optional[str],
        args: List[str],
        parent: Optional[click.Context] = None,
        **extra: Any,
    ) -> click.Context:
        """torchrun's PET_* variables, read now, below FTLAUNCH_* and the command line."""
        extra.setdefault("default_map", self.torchrun_defaults())
        return super().make_context(info_name, args, parent, **extra)

    def torchrun_defaults(self) -> Dict[str, str]:
        """What PET_* sets, for the options that FTLAUNCH_* may set: not SCRIPT, --version or --help."""
        names = [
            p.name for p in self.params if isinstance(p, click.Option) and p.allow_from_autoenv and p.name
        ]
        return torchrun_defaults(os.environ, names)

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
