"""ftlaunch's own lines on stderr.

A console that went away (``ftlaunch … 2>&1 | head``, a closed terminal, a SLURM step whose I/O
was torn down) must never stop the training, as the workers' output already does not (the log
pump): the first write error closes the console for ftlaunch's lines, and the run goes on. The
run dir keeps its record (run.json, the event log, each rank's log).
"""

import sys

__all__ = ["say"]

_lost = False


def say(line: str) -> None:
    global _lost
    if _lost:
        return
    try:
        sys.stderr.write(f"[ftlaunch] {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # EPIPE, EIO; ValueError: a closed stream
        _lost = True
