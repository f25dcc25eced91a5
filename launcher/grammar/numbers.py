"""Numbers as users write them: ASCII digits only. Python's int() and float() also take other
scripts' digits ("２", "٣") and underscores ("1_000"); what a shell script, a SLURM variable or a
torchrun command line means by a number never has them, so they are refused, not guessed."""

import re

__all__ = ["decimal", "digits", "whole_number"]

_WHOLE = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def digits(text: str) -> bool:
    """Only ASCII digits, at least one ("007" yes; "", "+7", "７" no)."""
    return text.isascii() and text.isdigit()


def whole_number(text: str) -> int:
    """An int from "12", "-1" or " 7 "; ValueError for anything else ("1.0", "１２", "1_0")."""
    stripped = text.strip()
    if not _WHOLE.fullmatch(stripped):
        raise ValueError(f"not a whole number: {text!r}")
    return int(stripped)


def decimal(text: str) -> float:
    """A float from "5", "0.5", ".5" or "1e3"; ValueError for anything else ("nan", "inf", "٥")."""
    stripped = text.strip()
    if not _DECIMAL.fullmatch(stripped):
        raise ValueError(f"not a number: {text!r}")
    return float(stripped)
