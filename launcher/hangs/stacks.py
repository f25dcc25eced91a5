"""Read the stack dumps that faulthandler writes into a rank's log before a hung group is stopped."""

import re
from pathlib import Path
from typing import Dict, Tuple

__all__ = ["last_stacks", "main_thread_stack", "short_frame"]

_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_TAIL_BYTES = 1 << 20  # the dump is at the end of the log; do not read gigabytes of it


def last_stacks(log_file: Path) -> Dict[int, Tuple[str, ...]]:
    """Thread id → its frames (innermost first), from the last dump in the log."""
    try:
        with open(log_file, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - _TAIL_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return {}
    stacks: Dict[int, Tuple[str, ...]] = {}
    current = None
    frames = []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            if current is not None:
                stacks[current] = tuple(frames)
            current, frames = int(header.group(1), 16), []
        elif current is not None and line.startswith("  File "):
            frames.append(line.strip())
        elif current is not None and line.strip():  # the dump ended; a later one overwrites
            stacks[current], current = tuple(frames), None
    if current is not None:
        stacks[current] = tuple(frames)
    return stacks


def main_thread_stack(log_file: Path, main_thread: int) -> Tuple[str, ...]:
    return last_stacks(log_file).get(main_thread, ())


def short_frame(frame: str) -> str:
    """'File "/a/b/train.py", line 37 in step' → 'step (train.py:37)'."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    return f"{match['func']} ({Path(match['path']).name}:{match['line']})"
