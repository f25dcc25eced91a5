"""The run's metrics served as Prometheus text on a port and/or written to a file for
node_exporter, each from a thread of its own that folds the events it has not seen yet. The
supervisor's loop waits for neither: the event list is read without its lock.
"""

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Iterator, Optional

from launcher.core.config import MetricsSection
from launcher.core.events import EventLog
from launcher.grammar.errors import UsageError
from launcher.observe.families import Family, families
from launcher.observe.metrics import RunMetrics

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["MetricsExporter", "NoExport", "open_exporter"]

log = logging.getLogger(__name__)

_FILE_EVERY_S = 5.0  # node_exporter reads the file at its own scrapes: a few seconds old at most


class MetricsExporter:
    """Opened before any worker starts (a busy port or an unwritable file is a usage error),
    given the run's event log once it exists (``watch``), closed at the end (the file is written
    one last time, with the run's final values)."""

    def __init__(self, section: MetricsSection, run: str, node: int) -> None:
        from prometheus_client import CollectorRegistry

        self._section = section
        self._labels = (("run", run), ("node", str(node)))
        self._metrics = RunMetrics()
        self._events: Optional[EventLog] = None
        self._seen = 0
        self._lock = threading.Lock()  # between the server's threads and the file's writer
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server = self._serve() if section.port is not None else None
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._unwritten = False
        self._writer: Optional[threading.Thread] = None
        if section.file is not None:
            try:
                self._probe_file()  # before any worker starts: an unwritable path is a usage error
            except UsageError:
                self.close()
                raise
            self._writer = threading.Thread(
                target=self._keep_writing, name="ftlaunch-metrics-file", daemon=True
            )
            self._writer.start()

    @property
    def port(self) -> Optional[int]:
        """The port the server listens on (the one asked for, or the OS's pick for 0)."""
        return self._server.server_port if self._server is not None else None

    def watch(self, events: EventLog) -> None:
        self._events = events
        self._kick.set()  # the run is this supervisor's: the file's first write, on the writer's thread

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._writer is not None:
            self._writer.join()
            if self._events is not None:  # the run was ours: its final values
                self._write_file()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> "MetricsExporter":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the collector prometheus_client asks at each scrape or write ----------------------------------

    def collect(self) -> Iterator["Metric"]:
        with self._lock:
            if self._events is not None:
                new = self._events.since(self._seen)
                self._seen += len(new)
                for logged in new:
                    self._metrics.fold(logged)
            current = families(self._metrics, time.monotonic(), time.time())
        for family in current:
            yield self._prometheus(family)

    def _prometheus(self, family: Family) -> "Metric":
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        names = [name for name, _ in self._labels]
        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "summary": SummaryMetricFamily}
        extra = [name for name, _ in family.samples[0][0]] if family.samples else []
        made = kinds[family.kind](family.name, family.help, labels=names + extra)
        for labels, value in family.samples:
            values = [v for _, v in self._labels] + [v for _, v in labels]
            if isinstance(value, tuple):  # a summary's (count, sum)
                count, total = value
                made.add_metric(values, count_value=count, sum_value=total)
            else:
                made.add_metric(values, value)
        return made

    # -- the port and the file ------------------------------------------------------------------

    def _serve(self):
        from prometheus_client import start_http_server

        where = f"{self._section.addr}:{self._section.port}"
        try:
            server, _thread = start_http_server(
                self._section.port, self._section.addr, registry=self.registry
            )
        except OSError as err:
            raise UsageError(f"--metrics-port: cannot listen on {where}: {err.strerror or err}") from None
        return server

    def _probe_file(self) -> None:
        """Whether the file can be written, without writing it: until this supervisor holds the
        run (``watch``), the file may be another live supervisor's (a second launch of a held
        run is refused), and its counters must not drop to 0 there."""
        path = self._section.file
        if path is None:
            return
        probe = path.with_name(f".{path.name}.probe.{os.getpid()}")
        try:
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as err:
            raise UsageError(f"--metrics-file: cannot write {path}: {err.strerror or err}") from None

    def _write_file(self) -> None:
        """Atomically (prometheus_client writes a temporary file beside it and renames it). A
        failure during the run (a full disk) is said once, and once more when it works again."""
        from prometheus_client import write_to_textfile

        path = self._section.file
        try:
            write_to_textfile(str(path), self.registry)
        except OSError as err:
            if not self._unwritten:
                log.warning(
                    "cannot write the metrics to %s (%s); trying again every %g s", path, err, _FILE_EVERY_S
                )
            self._unwritten = True
            return
        if self._unwritten:
            log.warning("the metrics are written to %s again", path)
        self._unwritten = False

    def _keep_writing(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(_FILE_EVERY_S)
            self._kick.clear()
            if self._events is not None and not self._stop.is_set():
                self._write_file()


class NoExport:
    """Neither --metrics-port nor --metrics-file: the events are kept for no one else."""

    port = None

    def watch(self, events: EventLog) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NoExport":
        return self

    def __exit__(self, *_exc: object) -> None:
        pass


def open_exporter(section: MetricsSection, run: str, node: int):
    """The exporter the options ask for (a busy port or an unwritable file: UsageError)."""
    if section.port is None and section.file is None:
        return NoExport()
    return MetricsExporter(section, run, node)
