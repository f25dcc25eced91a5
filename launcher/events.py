"""The run's event log: one JSON line per event, with a monotonic and a wall-clock time.

Monotonic times are what phases are measured with (they never jump); wall-clock time is
only for people reading the log.
"""

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

__all__ = ["EventLog"]

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path`` and keeps them in memory for the run summary."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")

    def emit(self, kind: str, **fields: Any) -> Dict[str, Any]:
        event = {"event": kind, "t_mono": time.monotonic(), "t_wall": time.time(), **fields}
        with self._lock:
            self.events.append(event)
            self._file.write(json.dumps(event, default=str) + "\n")
            self._file.flush()
        log.debug("event %s", event)
        return event

    def close(self) -> None:
        with self._lock:
            self._file.close()
