"""A bad node excluded (--exclude-after, node 0): a node surely blamed for that many failures
within --failure-window leaves the job, unhealthy (exit 8), when a standby can take its place;
without one it stays (excluding it would only stop or shrink the job) and is named as the node to
replace. The failures still count against --max-failures."""

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

from launcher.core.policy import RestartPolicy
from launcher.core.results import RunResult
from launcher.process.kit import NodeKit
from launcher.runs.run import Run

__all__ = ["Exclusion"]


class Exclusion:
    def __init__(self, policy: RestartPolicy, run: Run, kit: NodeKit) -> None:
        self._policy, self._run, self._kit = policy, run, kit
        self.to_replace: Dict[int, str] = {}  # nodes that reached the limit and stay: why

    def after_failure(
        self, ended: Optional[RunResult], standing_by: Sequence[int], members: List[dict]
    ) -> Tuple[Dict[int, str], Optional[RunResult]]:
        """After a failure, as the run goes on (``ended`` None: node → why, the node to exclude
        now, if any) or ends (``ended``, naming the nodes to replace)."""
        excluding = self._judge(standing_by, {m["node"]: m["host"] for m in members})
        if ended is None:
            return excluding, None
        if self.to_replace:
            ended = dataclasses.replace(ended, reason="; ".join([ended.reason, *self.to_replace.values()]))
        return {}, ended

    def _judge(self, standing_by: Sequence[int], hosts: Dict[int, str]) -> Dict[int, str]:
        """The node blamed for the failure that just ended, once blamed for --exclude-after."""
        found = self._policy.node_to_exclude(self._run.state.history(), time.time())
        if found is None:
            return {}
        node, failures = found
        within = f" within {self._policy.failure_window:g} s" if self._policy.failure_window else ""
        why = (
            f"node {node} ({hosts.get(node, '?')}) was the root cause of {failures} failure"
            f"{'s' if failures != 1 else ''}{within} "
            f"(--exclude-after {self._policy.exclude_after})"
        )
        if node == 0:
            self._name(node, f"{why}; node 0 leads and cannot be excluded: replace its machine")
            return {}
        if not standing_by:
            self._name(node, f"{why}; no standby node to take its place: it stays, replace it")
            return {}
        self._kit.say(f"{why}: excluded (it exits 8: drain or replace it); a standby takes its place")
        return {node: f"excluded: {why}"}

    def _name(self, node: int, why: str) -> None:
        if node not in self.to_replace:
            self._kit.say(why)
        self.to_replace[node] = why
