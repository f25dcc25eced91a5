"""``ftlaunch``: the launch, or a subcommand (``status``); ``main()`` maps errors to exit codes."""

import importlib
import sys
from typing import Any, List, Optional, Sequence, Tuple

import click

from launcher.cli import SUBCOMMANDS, subcommand_of
from launcher.cli.launch import launch
from launcher.grammar.errors import ExitCode, FtlaunchError
from launcher.process.signals import SignalInbox

__all__ = ["Ftlaunch", "ftlaunch", "main"]


class Ftlaunch(click.Group):
    """A subcommand where ``subcommand_of`` finds one (``status``); else a launch, whose own
    command parses every word (its options, SCRIPT, and SCRIPT's arguments, which are SCRIPT's)."""

    def __init__(self, default: click.Command) -> None:
        super().__init__("ftlaunch", add_help_option=False)  # --help is the launch's or a subcommand's
        self.default = default

    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        if cmd_name not in SUBCOMMANDS:
            return None
        module, _, name = SUBCOMMANDS[cmd_name].partition(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        ctx.args = list(args)  # the command they name parses them
        return ctx.args

    def resolve_command(
        self, ctx: click.Context, args: List[str]
    ) -> Tuple[Optional[str], Optional[click.Command], List[str]]:
        if subcommand_of(args):
            return super().resolve_command(ctx, args)
        return None, self.default, args

    def invoke(self, ctx: click.Context) -> Any:
        inbox: SignalInbox = ctx.obj
        if subcommand_of(ctx.args) is None:  # the launch: a context of its own, as the only command
            if not inbox.is_open:
                inbox.open()
            with self.default.make_context(ctx.info_name, ctx.args, obj=inbox) as own:
                return self.default.invoke(own)
        inbox.close()  # a subcommand only reads: Ctrl+C simply ends it, from its import on
        inbox.raise_if_received()
        name, command, args = self.resolve_command(ctx, ctx.args)
        assert name is not None and command is not None
        with command.make_context(name, args, parent=ctx) as sub:
            return command.invoke(sub)


ftlaunch = Ftlaunch(launch)


def main(argv: Optional[Sequence[str]] = None, signals: Optional[SignalInbox] = None) -> int:
    """The one place where errors become exit codes. ``signals``: an inbox the caller opened (the
    entry point opens one before it imports anything): SIGINT/SIGTERM/SIGHUP are recorded, never
    raised mid-import or mid-probe, and every stage of a launch acts on them (before start: exit at
    once; later: stop the workers)."""
    args = list(sys.argv[1:] if argv is None else argv)
    inbox = signals or SignalInbox()
    try:
        code: int = ftlaunch.main(args=args, prog_name="ftlaunch", standalone_mode=False, obj=inbox)
        return code
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
