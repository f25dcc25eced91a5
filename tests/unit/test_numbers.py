"""Numbers as users write them: ASCII digits only (launcher.grammar.numbers)."""

import math

import pytest

from launcher.grammar.durations import parse_duration
from launcher.grammar.errors import UsageError
from launcher.grammar.numbers import decimal, whole_number
from launcher.grammar.slurm import expand_hostlist, read_slurm_step


@pytest.mark.parametrize("text, value", [("12", 12), ("-1", -1), (" 7 ", 7), ("+3", 3), ("007", 7)])
def test_whole_numbers_as_a_shell_writes_them(text, value):
    assert whole_number(text) == value


@pytest.mark.parametrize("text", ["", "1.0", "1_000", "\uff12", "\u0663", "1e3", "0x10", "one", "- 1"])
def test_anything_else_is_no_whole_number(text):
    with pytest.raises(ValueError):
        whole_number(text)


@pytest.mark.parametrize("text, value", [("5", 5.0), ("0.5", 0.5), (".5", 0.5), ("5.", 5.0), ("1e3", 1000.0)])
def test_decimals_as_a_shell_writes_them(text, value):
    assert decimal(text) == value


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1_0", "\uff15", "\u0665.0", "", "."])
def test_anything_else_is_no_decimal(text):
    with pytest.raises(ValueError):
        decimal(text)


def test_a_duration_in_other_digits_is_refused():
    assert parse_duration("1.5m", "--x") == 90.0
    for text in ("\uff11\uff10", "1_0s", "infs"):
        with pytest.raises(UsageError, match="takes a duration like"):
            parse_duration(text, "--x")
    assert math.isfinite(parse_duration("0", "--x"))


def test_slurm_variables_and_ranges_take_ascii_digits_only():
    env = {"SLURM_JOB_ID": "12", "SLURM_STEP_NUM_NODES": "\uff12", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(UsageError, match="cannot read this SLURM step's environment"):
        read_slurm_step(env)
    assert read_slurm_step({**env, "SLURM_STEP_NUM_NODES": "2"}).nnodes == 2
    with pytest.raises(UsageError, match="cannot read the range"):
        expand_hostlist("n[\uff11-2]")
