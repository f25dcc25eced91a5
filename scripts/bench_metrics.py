"""What the metrics cost the supervisor, beside the same work without them.

The supervisor's process runs the exporter's threads, so a scrape competes with its loop for the
interpreter. Measured here with the real pieces (an EventLog on disk, the MetricsExporter and its
HTTP server, scrapes over loopback), in one process as in ftlaunch:

1. the loop: a 50 ms wait, then a few events emitted (what a monitor turn does), for --turns
   turns: how late each turn wakes and how long its emits take, with no exporter, with the port
   and the file open and a scrape a second (Prometheus' fastest usual interval; the file is
   written every 5 s), and while a scraper asks for /metrics as fast as the server answers;
2. a scrape after a weekend of events (48 h: a Steps event every 5 s, 40 attempts), the first one
   (it folds every event) and the next ones (only what is new), and the file's write.

    python scripts/bench_metrics.py [--turns 400]
"""

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from launcher.core.config import MetricsSection
from launcher.core.events import AttemptEnded, EventLog, KeptTime, Steps, Transition
from launcher.core.group_state import GroupState
from launcher.observe.exporter import MetricsExporter


def _turns(log: EventLog, turns: int) -> dict:
    late, emits = [], []
    for i in range(turns):
        start = time.monotonic()
        time.sleep(0.05)
        woke = time.monotonic()
        late.append((woke - start - 0.05) * 1e3)
        log.emit(Steps(0, i, i + 1, woke))
        log.emit(Steps(0, i, i + 1, woke))
        emits.append((time.monotonic() - woke) * 1e3)
    return {"late": late, "emit": emits}


def _scraper(url: str, pause: float, stop: threading.Event, count: list) -> None:
    while not stop.wait(pause):
        with urllib.request.urlopen(url, timeout=10) as answer:
            answer.read()
        count[0] += 1


def _loop(folder: Path, turns: int, pause: float) -> dict:
    """``pause``: seconds between scrapes; -1: no exporter at all."""
    with EventLog(folder / f"loop-{pause}.jsonl") as log:
        if pause < 0:
            return {**_turns(log, turns), "scrapes": 0}
        exporter = MetricsExporter(MetricsSection(port=0, file=folder / f"loop-{pause}.prom"), "bench", 0)
        exporter.watch(log)
        stop, count = threading.Event(), [0]
        thread = threading.Thread(
            target=_scraper, args=(f"http://127.0.0.1:{exporter.port}/metrics", pause, stop, count)
        )
        thread.start()
        try:
            return {**_turns(log, turns), "scrapes": count[0]}
        finally:
            stop.set()
            thread.join()
            exporter.close()


def _weekend(log: EventLog) -> int:
    """48 h of a run: a Steps event every 5 s, an attempt (and its failure) every 72 minutes."""
    since = time.time()
    for attempt in range(40):
        log.emit(Transition(attempt, None, GroupState.STARTING))
        log.emit(Transition(attempt, GroupState.STARTING, GroupState.RUNNING))
        log.emit(KeptTime(attempt * 4000.0, since, True))
        for i in range(864):
            log.emit(Steps(attempt, attempt * 864 + i, attempt * 864 + i, time.monotonic()))
        log.emit(Transition(attempt, GroupState.RUNNING, GroupState.FAILED, failed_at=time.monotonic()))
        log.emit(Transition(attempt, GroupState.FAILED, GroupState.STOPPING))
        log.emit(Transition(attempt, GroupState.STOPPING, GroupState.STOPPED))
        log.emit(AttemptEnded(attempt, "FAILED", "crash", rank=0, restarting=True))
    return len(log.logged)


def _scrapes(folder: Path) -> dict:
    with EventLog(folder / "weekend.jsonl") as log:
        events = _weekend(log)
        exporter = MetricsExporter(MetricsSection(port=0, file=folder / "m.prom"), "bench", 0)
        exporter.watch(log)
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        try:
            timed = []
            for _ in range(21):
                start = time.monotonic()
                with urllib.request.urlopen(url, timeout=60) as answer:
                    size = len(answer.read())
                timed.append((time.monotonic() - start) * 1e3)
            start = time.monotonic()
            exporter._write_file()
            written = (time.monotonic() - start) * 1e3
        finally:
            exporter.close()
    return {
        "events": events,
        "first": timed[0],
        "next": statistics.median(timed[1:]),
        "size": size,
        "file": written,
    }


def _p(values, q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs = [
            ("no metrics (baseline)", _loop(folder, args.turns, -1)),
            ("port and file, a scrape a second", _loop(folder, args.turns, 1.0)),
            ("a scraper asking without pause", _loop(folder, args.turns, 0.0)),
        ]
        weekend = _scrapes(folder)
    print(f"the loop: {args.turns} turns of a 50 ms wait and two events emitted (ms)")
    print(f"{'':<34}{'wake late p50':>14}{'p99':>8}{'emits p50':>11}{'p99':>8}{'scrapes/s':>11}")
    for name, run in runs:
        rate = run["scrapes"] / (args.turns * 0.05)
        print(
            f"{name:<34}{_p(run['late'], 0.5):>14.3f}{_p(run['late'], 0.99):>8.3f}"
            f"{_p(run['emit'], 0.5):>11.3f}{_p(run['emit'], 0.99):>8.3f}{rate:>11.0f}"
        )
    print()
    print(f"a scrape after a weekend's {weekend['events']} events ({weekend['size']} bytes of text)")
    print(
        f"  first (folds them all): {weekend['first']:.1f} ms; next (median of 20): {weekend['next']:.1f} ms"
    )
    print(f"  --metrics-file write: {weekend['file']:.1f} ms")


if __name__ == "__main__":
    main()
