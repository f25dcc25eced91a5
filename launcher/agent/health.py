"""The node's health check before each attempt (before it joins, before each restart): the user's
--health-check command, then the built-in checks (the storage the node writes, the memory tier's
room, the GPUs its ranks would use). The first failure makes the node unhealthy (NodeUnhealthy,
exit 8): one line naming the check and why, the command's last lines of output with it."""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Mapping, Optional

from launcher.core.config import HealthSection
from launcher.core.events import HealthChecked
from launcher.core.health import CheckResult, CheckStatus, HealthReport
from launcher.forked.gpu_probe import GPU_PROBE_MODULE, MARK
from launcher.grammar.errors import CheckStopped, NodeUnhealthy, SignalReceived, UsageError
from launcher.process.health_command import CommandEnd, run_check
from launcher.process.kit import NodeKit
from launcher.process.memory_tier import room_for_tier
from launcher.process.orphan_guard import OrphanGuard
from launcher.runs.probe import probe_storage
from worker_lib.core.contract import FT_NODE_RANK

__all__ = ["HealthTerms", "NodeHealth", "ranks_gpus"]

LOG_NAME = "health.log"  # in the node's log dir: every check's output, each under a header


@dataclasses.dataclass(frozen=True)
class HealthTerms:
    """What the checks need: the option's section, this node, where its ranks write (the run dir
    where this node holds the run), and which GPUs its ranks would use (None: the node's backend
    is gloo, it uses none)."""

    section: HealthSection
    node: int
    log_dir: Path
    storage: Mapping[str, str]  # a label ("run dir (--run-dir)") -> its URL
    storage_timeout: float
    gpus: Optional[str]  # CUDA_VISIBLE_DEVICES as the ranks would see them


def ranks_gpus(nproc: int, backend: str, visible: Optional[str]) -> Optional[str]:
    """The GPUs this node's ranks use: local rank i takes cuda:i of the node's own
    CUDA_VISIBLE_DEVICES (``visible``), so the first ``nproc`` of them. None where gloo."""
    if backend != "nccl":
        return None
    listed = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(nproc)]
    return ",".join(listed[:nproc])


class NodeHealth:
    """``memory``: the node's memory-tier folder (None: it has none)."""

    def __init__(self, terms: HealthTerms, kit: NodeKit, guard: OrphanGuard, memory: Optional[Path]) -> None:
        self.terms = terms
        self._kit = kit
        self._guard = guard
        self._memory = memory
        self.log = terms.log_dir / LOG_NAME

    def check(self, restart: bool) -> None:
        """Every check, in order, until one fails: NodeUnhealthy. SignalReceived from a signal
        (before or during a check, which is killed)."""
        started = time.monotonic()
        before = "restart" if restart else "start"
        when = "a restart" if restart else "its first attempt"
        results: List[CheckResult] = []
        try:
            for step in (self._command, self._storage, self._tier, self._gpus):
                results += step(restart)
                if results and results[-1].status is CheckStatus.FAILED:
                    break
            self._kit.signals.raise_if_received()  # what a signal killed is no verdict on the node
        except SignalReceived as stop:
            raise CheckStopped(stop.signum, stop.said_as) from None
        report = HealthReport(tuple(results))
        failure = report.failure
        self._kit.events.emit(
            HealthChecked(
                before=before,
                healthy=failure is None,
                passed=list(report.named(CheckStatus.PASSED)),
                unknown=list(report.named(CheckStatus.UNKNOWN)),
                failed=failure.name if failure else "",
                detail=failure.detail if failure else "",
                seconds=round(time.monotonic() - started, 3),
            )
        )
        if failure is not None:
            raise NodeUnhealthy(f"{report.line(self.terms.node)} (before {when}; log: {self.log})")
        if self.terms.section.command:  # the built-in checks alone pass quietly (events.jsonl has them)
            self._kit.say(report.line(self.terms.node))

    # -- the checks, each a list of results (its last one failed: the node is unhealthy) --------

    def _command(self, restart: bool) -> List[CheckResult]:
        command = self.terms.section.command
        if not command:
            return []
        self._header("--health-check", command, restart)
        end = self._run(["/bin/sh", "-c", command], self.terms.section.timeout)
        if end.returncode == 0:
            return [CheckResult.passed("--health-check", f"exit 0 in {end.seconds:.2f} s")]
        return [CheckResult.failed("--health-check", end.describe(self.terms.section.timeout))]

    def _storage(self, restart: bool) -> List[CheckResult]:
        """Written by the preflight probe at the start; probed again before a restart (storage
        may have died since). A write that fails then is no verdict on this node: shared storage
        that stopped answering fails every node's write alike, and a blip is not a death. It is
        said, and the run dir's lease decides (exit 7), as without the check."""
        results = []
        for label, url in self.terms.storage.items():
            name = label.split(" (")[0]
            if not restart:
                results.append(CheckResult.passed(name, "written by the launch's own check"))
                continue
            try:
                probe_storage(label, url, self.terms.storage_timeout, self._interrupted)
            except UsageError as err:
                self._kit.say(f"before the restart: {err}; the run goes on while the run dir's lease holds")
                results.append(CheckResult.unknown(name, str(err)))
                continue
            results.append(CheckResult.passed(name, "written"))
        return results

    def _tier(self, restart: bool) -> List[CheckResult]:
        return [room_for_tier(self._memory)]

    def _gpus(self, restart: bool) -> List[CheckResult]:
        if self.terms.gpus is None:
            return [CheckResult.unknown("gpus", "this node's ranks use no GPU: backend gloo")]
        self._header("gpus", f"CUDA_VISIBLE_DEVICES={self.terms.gpus}", restart)
        timeout = self.terms.section.timeout
        end = self._run([sys.executable, "-u", "-m", GPU_PROBE_MODULE], timeout)
        said = _gpu_lines(end)
        if end.returncode in (0, 1) and said:
            failed = [i for i, r in enumerate(said) if r.status is CheckStatus.FAILED]
            return said[: failed[0] + 1] if failed else said
        return [CheckResult.failed("gpus", f"the GPU check's process: {end.describe(timeout)}")]

    # -- mechanics -----------------------------------------------------------------------------

    def _run(self, argv: List[str], timeout: float) -> CommandEnd:
        return run_check(argv, self._environment(), self.log, timeout, self._kit.signals, self._guard)

    def _environment(self) -> Mapping[str, str]:
        env = dict(os.environ)
        env[FT_NODE_RANK] = str(self.terms.node)
        if self.terms.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.terms.gpus
        return env

    def _header(self, what: str, command: str, restart: bool) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        before = "a restart" if restart else "the node's first attempt"
        with open(self.log, "a") as out:
            out.write(f"=== {stamp} {what} before {before}: {command}\n")

    def _interrupted(self) -> None:
        self._kit.signals.raise_if_received()


def _gpu_lines(end: CommandEnd) -> List[CheckResult]:
    """The probe's own lines among its output (CUDA's warnings may come between)."""
    results = []
    for line in end.lines:
        if line.startswith(MARK.strip()):
            said = json.loads(line[len(MARK.strip()) :])
            results.append(CheckResult(said["name"], CheckStatus(said["status"]), said["detail"]))
    return results
