"""Durations as users write them on the command line and in --chaos specs."""

import math

from launcher.grammar.errors import UsageError
from launcher.grammar.numbers import decimal

__all__ = ["parse_duration"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str, option: str) -> float:
    """Seconds from "90", "90s", "1.5m", "2h" or "1d"."""
    text = value.strip().lower()
    number, unit = text.rstrip("smhd"), text[len(text.rstrip("smhd")) :]
    try:
        seconds = decimal(number) * _UNITS[unit]
    except (ValueError, KeyError):
        seconds = math.nan
    if not math.isfinite(seconds):  # "nan" and "inf" parse as floats: a deadline of nan never fires
        raise UsageError(f"{option} takes a duration like 90, 90s, 15m or 2h, got {value!r}")
    if seconds < 0:
        raise UsageError(f"{option} must not be negative, got {value!r}")
    return seconds
