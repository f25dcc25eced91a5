"""Typed reading of what ftlaunch wrote to storage as JSON (run.json, progress.json, a node's
progress share): a value no supervisor writes is damage, refused where the file is read, so no
reader meets 1e300, NaN or "zero" later."""

import dataclasses
import enum
import functools
import typing
from typing import Any, Dict, Mapping

__all__ = ["LATEST_WALL", "LARGEST_INT", "SMALLEST_INT", "check_fields", "check_record", "fits"]

# Every float such a file holds is a wall-clock time or seconds, every int a step, an attempt, a
# pid, a rank, a node or an exit code.
LATEST_WALL = 253402300799.0  # 9999-12-31 23:59:59 UTC: later is no date (time_t, strftime)
LARGEST_INT = 2**63 - 1  # int64, as torch and the OS hold steps and pids
SMALLEST_INT = -(2**63)


@functools.cache
def _declared(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(cls: type, data: Any, lowest: Mapping[str, int] = {}, ints_from: int = 0) -> None:
    """ValueError naming the first of ``data``'s fields that ``cls`` would not hold as declared
    (ints from ``lowest[name]`` or ``ints_from``, floats from 0); TypeError when ``data`` is no
    JSON object. Unknown and missing fields are the constructor's."""
    if not isinstance(data, dict):
        raise TypeError(f"a JSON object was expected, not {type(data).__name__}")
    declared = _declared(cls)
    for name, value in data.items():
        if name in declared and not fits(value, declared[name], lowest.get(name, ints_from)):
            raise ValueError(f"{name} is {value!r}"[:80])


def check_record(cls: type, data: Any, lowest: Mapping[str, int] = {}) -> None:
    """``check_fields``, and a ValueError naming a field ``cls`` requires that ``data`` lacks, or
    one it does not have."""
    check_fields(cls, data, lowest)
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    required = [f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ValueError(f"{missing[0]} is missing")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]!r} is no field of it"[:80])


def fits(value: Any, kind: Any, lowest: int = 0) -> bool:
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union:  # Optional[X]: None, or an X
        return value is None or fits(value, next(a for a in args if a is not type(None)), lowest)
    if isinstance(value, bool) or kind is bool:  # a bool is an int to Python, never to our files
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and lowest <= value <= LARGEST_INT
    if kind is float:  # NaN fails both comparisons
        return isinstance(value, (int, float)) and 0 <= value <= LATEST_WALL
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return isinstance(value, str) and value in {member.value for member in kind}  # str enums
    if dataclasses.is_dataclass(kind):  # a record within: its own from_json checks its fields
        return isinstance(value, dict)
    origin = typing.get_origin(kind) or kind
    if origin is list:
        return isinstance(value, list) and all(fits(item, args[0], lowest) for item in value)
    return isinstance(value, origin)  # str, dict
