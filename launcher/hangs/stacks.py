"""Read the stack dumps that faulthandler writes into a rank's log before a hung group is stopped."""

import re
from pathlib import Path
from typing import Dict, List, Tuple

from launcher.forked.protocol import ZYGOTE_MODULE

__all__ = ["last_stacks", "main_thread_stack"]

_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_TAIL_BYTES = 1 << 20  # the dump is at the end of the log; do not read gigabytes of it
# The frames that run the script (the zygote, runpy): what ftlaunch shows starts below them, as a
# plain ``python SCRIPT``'s dump does.
_ZYGOTE_FILE = re.escape(ZYGOTE_MODULE.replace(".", "/")) + r"\.py"
_RUNNER = re.compile(rf'^File "(?:<frozen runpy>|.*/runpy\.py|.*/{_ZYGOTE_FILE})", line \d+ in ')


def last_stacks(log_file: Path) -> Dict[int, Tuple[str, ...]]:
    """Thread id → its frames (innermost first, the script's outermost last), from the last dump
    in the log."""
    try:
        with open(log_file, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - _TAIL_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return {}
    stacks: Dict[int, Tuple[str, ...]] = {}
    current = None
    frames: List[str] = []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            if current is not None:
                stacks[current] = _from_the_script(frames)
            current, frames = int(header.group(1), 16), []
        elif current is not None and line.startswith("  File "):
            frames.append(line.strip())
        elif current is not None and line.strip():  # the dump ended; a later one overwrites
            stacks[current], current = _from_the_script(frames), None
    if current is not None:
        stacks[current] = _from_the_script(frames)
    return stacks


def _from_the_script(frames: List[str]) -> Tuple[str, ...]:
    """The frames without the runner's below the script's (all of them where nothing else is)."""
    end = len(frames)
    while end > 0 and _RUNNER.match(frames[end - 1]):
        end -= 1
    return tuple(frames[:end] or frames)


def main_thread_stack(log_file: Path, main_thread: int) -> Tuple[str, ...]:
    return last_stacks(log_file).get(main_thread, ())
