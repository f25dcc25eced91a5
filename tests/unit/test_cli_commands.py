"""``ftlaunch``'s words, dispatched by click (launcher/cli/main.py): ``status`` is a subcommand
with its own options and --help unless a file named ``status`` is in the working directory, and
every word after SCRIPT is SCRIPT's. Nothing is launched here (tests/test_cli.py runs a script
named ``status`` for real)."""

from typing import List, Tuple

import click
import pytest
from click.testing import CliRunner

from launcher.cli.launch import launch, options_of
from launcher.cli.main import ftlaunch
from launcher.cli.status import status
from launcher.process.signals import SignalInbox


def _resolved(args: List[str]) -> Tuple[click.Command, List[str]]:
    """The command ``ftlaunch ARGS`` runs, and the words it is handed."""
    with ftlaunch.make_context("ftlaunch", list(args)) as context:
        _, command, rest = ftlaunch.resolve_command(context, context.args)
    assert command is not None
    return command, rest


def test_status_has_its_own_help():
    ran = CliRunner().invoke(ftlaunch, ["status", "--help"], prog_name="ftlaunch", obj=SignalInbox())
    assert ran.exit_code == 0, ran.output
    assert ran.output.startswith("Usage: ftlaunch status [OPTIONS] [RUN]\n")
    for option in ("--run-dir", "--json", "--plot", "FTLAUNCH_RUN_DIR"):
        assert option in ran.output
    assert "--nproc" not in ran.output  # the launch's, not status's


def test_the_launch_keeps_its_own_help():
    ran = CliRunner().invoke(ftlaunch, ["--help"], prog_name="ftlaunch", obj=SignalInbox())
    assert ran.exit_code == 0, ran.output
    assert ran.output.startswith("Usage: ftlaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...\n")
    assert "--nproc" in ran.output and "--json" not in ran.output


def test_status_is_the_subcommand_without_a_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _resolved(["status", "--json", "run"]) == (status, ["--json", "run"])


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_script_named_status_here_is_launched_with_its_arguments(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "status").mkdir() if kind == "folder" else (tmp_path / "status").write_text("")
    assert _resolved(["status", "--json", "run"]) == (launch, ["status", "--json", "run"])


@pytest.mark.parametrize(
    "args",
    [
        ["--nproc", "1", "status"],  # status after an option is SCRIPT
        ["train.py", "status"],
        [],  # the launch says SCRIPT is missing
    ],
)
def test_every_other_command_line_is_a_launch(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    assert _resolved(args) == (launch, args)


def test_options_after_the_script_are_the_scripts(monkeypatch):
    monkeypatch.delenv("FTLAUNCH_NPROC", raising=False)
    monkeypatch.delenv("PET_NPROC", raising=False)
    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    args = ["--nproc", "2", "train.py", "--nproc", "3", "--help", "--version", "status"]
    assert _resolved(args) == (launch, args)
    options = options_of(args)
    assert options["nproc"] == "2" and options["script"] == "train.py"
    assert options["script_args"] == ("--nproc", "3", "--help", "--version", "status")


def test_a_defect_is_said_of_the_command_that_ran(tmp_path, monkeypatch):
    """The entry point's line after a traceback tells status from a launch by the same rule."""
    from launcher.__main__ import defect_line

    monkeypatch.chdir(tmp_path)
    assert defect_line(["status", "run"]).endswith("it changed nothing\n")
    (tmp_path / "status").write_text("")
    assert defect_line(["status", "run"]).endswith("the same command resumes the run\n")
