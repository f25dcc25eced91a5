"""A real Prometheus server on loopback, for the test that has it scrape a run: Debian's
``prometheus`` package (installed by ``make install``'s system step, or here with apt when missing
and this is root), started on a free port of 127.0.0.1 with a configuration that scrapes the given
targets every second, asked through its HTTP query API, and stopped by PID."""

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import List, Optional

__all__ = ["Prometheus", "why_not_here"]

_PACKAGE = "prometheus"


def why_not_here() -> Optional[str]:
    """None when a prometheus server can run here (installing Debian's package if need be, as
    root), else why not."""
    if shutil.which("prometheus"):
        return None
    if os.geteuid() != 0:
        return "Debian's prometheus package is not installed; only root can install it (make install does)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", _PACKAGE]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                return f"apt-get could not install {_PACKAGE}: {done.stderr.strip().splitlines()[-1:]}"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"apt-get could not install {_PACKAGE}: {err}"
    return None if shutil.which("prometheus") else f"{_PACKAGE} installed, but no prometheus binary on PATH"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """One server, scraping ``targets`` (HOST:PORT) every second; ``stop()`` by PID."""

    def __init__(self, folder: Path, targets: List[str]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        listed = ", ".join(f'"{t}"' for t in targets)
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            f"scrape_configs:\n  - job_name: ftlaunch\n    static_configs:\n      - targets: [{listed}]\n"
        )
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = folder / "prometheus.log"
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                [
                    shutil.which("prometheus"),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self._wait_ready(timeout=60)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                said = self.log.read_text()[-2000:]
                raise AssertionError(f"prometheus exited {self._proc.returncode}: {said}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout} s: {self.log.read_text()[-2000:]}")

    def query(self, expr: str) -> List[dict]:
        """The instant vector ``expr`` evaluates to now: [{"metric": {...}, "value": [t, "v"]}]."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> Optional[float]:
        """The one sample ``expr`` selects, as a float (NaN included); None while there is none."""
        found = self.query(expr)
        assert len(found) <= 1, found
        return float(found[0]["value"][1]) if found else None

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
