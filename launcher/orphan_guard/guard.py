"""The orphan guard's process (its protocol: ``launcher.orphan_guard``)."""

import os
import shutil
import signal
import sys
from typing import IO, Dict, List, Optional

from launcher.orphan_guard import REMOVE_AT_END, WATCH


def _guard(lines: IO[str]) -> int:
    # pgid → its leader's start time when the group was listed (None: the leader had gone)
    groups: Dict[int, Optional[str]] = {}
    folders: List[str] = []
    for line in lines:
        op, arg = line[:1], line[1:].rstrip("\n")
        if op == REMOVE_AT_END:
            folders.append(arg)
        elif op == WATCH:
            groups[int(arg)] = _started(int(arg))
        else:
            groups.pop(int(arg), None)
    for pgid, started in groups.items():
        if _reused(started, _started(pgid)):
            continue
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _reused(then: Optional[str], now: Optional[str]) -> bool:
    """Whether a listed group's number belongs to another process now: the kernel gives a pid
    out again only once no group uses it as its id, so a process with the group's number that
    is not the leader listed means the listed group is gone and the new owner is a stranger."""
    return now is not None and now != then


def _started(pid: int) -> Optional[str]:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field); None if no
    process has that pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(_guard(sys.stdin))
