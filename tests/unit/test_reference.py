"""docs/reference.md's tables against what the code declares: every option click knows is in the
table and nothing else, with click's default and the variables that really set it (click's own
FTLAUNCH_* resolution, launcher.cli.environment's PET_* mapping); the exit codes are ExitCode's.
Help texts are not compared (the table says it in its own words), but for the one list both give:
--rdzv-conf's settings."""

import os
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import click
import pytest

from launcher.cli import environment
from launcher.cli.environment import PET_PREFIX
from launcher.cli.launch import launch
from launcher.cli.main import main
from launcher.cli.options import ENV_PREFIX
from launcher.cli.status import status
from launcher.grammar.errors import ExitCode

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
NONE = "—"


class Row:
    def __init__(self, cells: List[str]) -> None:
        self.options = re.findall(r"`(-{1,2}[A-Za-z][\w-]*)`", cells[0])
        self.default = cells[1]
        self.variables = _variables(cells[2])
        self.meaning = cells[3]

    def __repr__(self) -> str:
        return f"Row({self.options}, default={self.default!r}, variables={self.variables})"


def _variables(cell: str) -> Set[Tuple[str, ...]]:
    """'`A`, `B`:`C`' -> {('A',), ('B', 'C')}: a pair is two variables that together set it."""
    if cell.strip() == NONE:
        return set()
    return {tuple(re.findall(r"`([A-Z_]+)`", item)) for item in cell.split(",")}


def _table(heading: str) -> List[Row]:
    """The rows of the first table under ``## heading``."""
    section = REFERENCE.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")][2:]  # head, rule
    return [Row([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]) for line in lines]


def _options(command: click.Command, context: click.Context) -> List[click.Option]:
    return [p for p in command.get_params(context) if isinstance(p, click.Option)]


def _rows_by_option(rows: List[Row]) -> Dict[str, Row]:
    found: Dict[str, Row] = {}
    for row in rows:
        for name in row.options:
            assert name not in found, f"{name} appears twice in {REFERENCE.name}"
            found[name] = row
    return found


def _check_names(command: click.Command, context: click.Context, rows: List[Row]) -> Dict[str, Row]:
    by_option = _rows_by_option(rows)
    declared = {name for p in _options(command, context) for name in p.opts + p.secondary_opts}
    assert sorted(declared - set(by_option)) == [], f"options missing from {REFERENCE.name}"
    assert sorted(set(by_option) - declared) == [], f"options in {REFERENCE.name} that click lacks"
    return by_option


def _check_default(option: click.Option, context: click.Context, cell: str) -> None:
    name = option.opts[-1]
    if not option.expose_value:  # --help, --version: no value
        assert cell == NONE, f"{name}: default should be {NONE}"
        return
    default = option.get_default(context, call=True)
    if option.is_flag and option.is_bool_flag:
        assert cell == ("on" if default else "off"), f"{name}: click's default is {default}, not {cell!r}"
        return
    literal = re.match(r"`([^`]*)`", cell)
    if default in (None, ""):  # derived, or unset: the table says so in words
        assert literal is None, f"{name}: click has no default, the table states `{literal and literal[1]}`"
        return
    assert literal is not None, f"{name}: click's default is {default!r}, the table states none"
    stated = option.type_cast_value(context, literal[1])
    assert stated == default, f"{name}: {literal[1]!r} is not click's {default!r}"


def test_every_ftlaunch_option_is_in_the_table_with_clicks_default():
    context = click.Context(launch, info_name="ftlaunch", auto_envvar_prefix=ENV_PREFIX)
    by_option = _check_names(launch, context, _table("`ftlaunch` options"))
    for option in _options(launch, context):
        _check_default(option, context, by_option[option.opts[0]].default)


def test_every_status_option_is_in_the_table_with_clicks_default():
    context = click.Context(status, info_name="ftlaunch status")
    by_option = _check_names(status, context, _table("`ftlaunch status` options"))
    for option in _options(status, context):
        _check_default(option, context, by_option[option.opts[0]].default)


@pytest.fixture
def bare_environ(monkeypatch):
    for key in list(os.environ):
        if key.startswith((PET_PREFIX, f"{ENV_PREFIX}_", "SLURM_")):
            monkeypatch.delenv(key)
    return monkeypatch


def _ftlaunch_variables(option: click.Option, context: click.Context, candidates, env) -> Set[Tuple[str]]:
    """The FTLAUNCH_* names click itself resolves for ``option``, each tried alone."""
    found = set()
    for name in candidates:
        env.setenv(name, "1")
        if option.resolve_envvar_value(context) is not None:
            found.add((name,))
        env.delenv(name)
    return found


def _pet_variables(option: click.Option, candidates, env) -> Set[Tuple[str, ...]]:
    """The PET_* names (or pairs) that the launch's own mapping (launcher.cli.environment, for the
    options launcher.cli hands it) puts onto ``option``, each tried alone."""
    found = set()
    for group in candidates:
        for name in group:
            env.setenv(name, "c10d")
        if option.name in launch.torchrun_defaults():
            found.add(group)
        for name in group:
            env.delenv(name)
    return found


def test_the_tables_variables_are_the_ones_that_set_each_option(bare_environ):
    context = click.Context(launch, info_name="ftlaunch", auto_envvar_prefix=ENV_PREFIX)
    options = _options(launch, context)
    by_option = _rows_by_option(_table("`ftlaunch` options"))
    listed = {group for row in by_option.values() for group in row.variables}
    ours = {f"{ENV_PREFIX}_{p.name.upper()}" for p in options if p.name} | {
        g[0] for g in listed if g[0].startswith(f"{ENV_PREFIX}_")
    }
    pets = {(f"{PET_PREFIX}{p.name.upper()}",) for p in options if p.name}
    pets |= {(PET_PREFIX + name,) for name in environment._RENAMED}
    pets |= {tuple(PET_PREFIX + name for name in environment._MASTER)}
    pets |= {g for g in listed if g[0].startswith(PET_PREFIX)}
    for option in options:
        expected = _ftlaunch_variables(option, context, sorted(ours), bare_environ)
        expected |= _pet_variables(option, pets, bare_environ)
        row = by_option.get(option.opts[0])
        assert row is not None and row.variables == expected, option.opts[-1]


def test_the_status_tables_variables_are_the_ones_that_set_each_option(bare_environ):
    """As main() calls it. --run-dir reads what the launch's --run-dir reads (a SLURM script
    exports FTLAUNCH_RUN_DIR for both); --json, --plot and --help read nothing."""
    context = click.Context(status, info_name="ftlaunch status")
    by_option = _rows_by_option(_table("`ftlaunch status` options"))
    names = [p.name.upper() for p in _options(status, context) if p.name]
    candidates = sorted({f"{prefix}{name}" for prefix in (f"{ENV_PREFIX}_", PET_PREFIX) for name in names})
    for option in _options(status, context):
        expected = _ftlaunch_variables(option, context, candidates, bare_environ)
        assert by_option[option.opts[0]].variables == expected, option.opts[-1]
    launch = _rows_by_option(_table("`ftlaunch` options"))["--run-dir"]
    assert by_option["--run-dir"].variables == launch.variables


def test_status_looks_for_runs_where_the_launch_put_them(bare_environ, tmp_path, capsys):
    """`ftlaunch status` beside an exported FTLAUNCH_RUN_DIR answered "no runs under
    ftlaunch_runs". The order is the launch's: --run-dir, FTLAUNCH_RUN_DIR, PET_RUN_DIR."""
    bare_environ.chdir(tmp_path)

    def listing(*args: str) -> str:
        assert main(["status", *args]) == 0
        return capsys.readouterr().out.strip()

    assert listing() == "no runs under ftlaunch_runs"
    bare_environ.setenv(f"{PET_PREFIX}RUN_DIR", "pets")
    assert listing() == "no runs under pets"
    bare_environ.setenv(f"{ENV_PREFIX}_RUN_DIR", "ours")
    assert listing() == "no runs under ours"
    assert listing("--run-dir", "given") == "no runs under given"


def test_rdzv_conf_names_every_setting_its_parser_takes_in_the_help_and_the_table():
    """--help left out heartbeat, which the parser takes."""
    from launcher.cli.sections import _RDZV_KEYS

    (option,) = [p for p in launch.params if p.name == "rdzv_conf"]
    row = _rows_by_option(_table("`ftlaunch` options"))["--rdzv-conf"]
    for text in (option.help or "", row.meaning):
        assert re.search(r"\(([a-z_, ]+)\)", text)[1].split(", ") == list(_RDZV_KEYS), text


def test_the_exit_code_table_is_exit_code():
    section = REFERENCE.read_text().split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    codes = [int(m) for m in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)]
    assert codes == sorted(int(code) for code in ExitCode)
