"""Numbers as users write them: ASCII digits only. Python's int() and float() also take other
scripts' digits ("２", "٣") and underscores ("1_000"); what a shell script, a SLURM variable or a
torchrun command line means by a number never has them, so they are refused, not guessed."""

import re

__all__ = ["byte_rate", "decimal", "digits", "whole_number"]

_WHOLE = re.compile(r"[+-]?[0-9]+")
_BYTES = re.compile(r"([0-9]+\.?[0-9]*)\s*([KMGT]i?B|B)?", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
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


def byte_rate(text: str) -> int:
    """Bytes from "500MB", "1.5GB", "2GiB" or "1000000" (a unit of bytes: B, KB, MB, GB, TB are
    powers of 1000, KiB..TiB of 1024); ValueError for anything else ("fast", "-1MB", "1e9")."""
    found = _BYTES.fullmatch(text.strip())
    if not found or len(found.group(1)) > 20:  # beyond any machine's bytes (and float's range)
        raise ValueError(f"not a number of bytes: {text!r}")
    exact = float(found.group(1)) * _UNITS[(found.group(2) or "").lower()]
    if 0 < exact < 1:  # "0.5" would round to 0, which means no cap at all
        raise ValueError(f"less than a byte: {text!r}")
    return int(exact)
