"""What this node brings to a job of many nodes, and must agree on with the others."""

import dataclasses
from typing import Dict, Tuple

from launcher.cluster.wire import NodeInfo
from launcher.core.config import ClusterSection

__all__ = ["Membership"]

# Beyond --node-timeout, for the nodes of a round to announce themselves: a loaded machine's
# process may learn of the round a few seconds late.
_ANNOUNCE_SLACK_S = 5.0


@dataclasses.dataclass(frozen=True)
class Membership:
    """The cluster's options, this node's ranks and command, the run's id, and the grace period
    (how long a node's stop, and so its report, may take)."""

    cluster: ClusterSection
    nproc: int
    command: Tuple[str, ...]
    run_id: str
    grace_period: float
    copies: str = ""  # this node's copy server (HOST:PORT), told to node 0 as it announces itself

    @property
    def node(self) -> int:
        return self.cluster.node_rank

    @property
    def rdzv_id(self) -> str:
        return self.cluster.rdzv_id or self.run_id

    def info(self) -> NodeInfo:
        """This node as it announces itself to node 0."""
        return NodeInfo.here(self.node, self.nproc, self.command, self.cluster.standby, self.copies)

    @property
    def announce_timeout(self) -> float:
        """How long node 0 waits for the nodes of a round to announce themselves. A live node does
        so as soon as it learns of the round (torch's rendezvous tells a waiting node within about
        a second); one that has not within --node-timeout and some slack died on the way, and
        torch drops it from the rendezvous after about as long (its keep-alive)."""
        return self.cluster.node_timeout + _ANNOUNCE_SLACK_S

    @property
    def report_timeout(self) -> float:
        """How long a node may take, after its attempt ended, to say so: stopping its ranks (the
        grace period, twice: a cooperative stop, then the signals) and a node timeout's slack."""
        return 2 * self.grace_period + self.cluster.node_timeout + 10.0

    def disagreement(self, infos: Dict[int, NodeInfo]) -> str:
        """Nodes started with other commands or other --nproc cannot form one job."""
        for node, info in sorted(infos.items()):
            differs = self.differs(info, f"node {node} ({info.host})", "node 0")
            if differs:
                return differs
        return ""

    def differs(self, info: NodeInfo, theirs: str, ours: str) -> str:
        """How ``info``'s node (named ``theirs``) would not form one job with this one (``ours``)."""
        if info.nproc != self.nproc:
            return f"{theirs} runs --nproc {info.nproc}, {ours} runs --nproc {self.nproc}"
        if info.standby != self.cluster.standby:
            standby = self.cluster.standby
            return f"{theirs} runs --standby-nodes {info.standby}, {ours} runs --standby-nodes {standby}"
        if tuple(info.command) != self.command:
            return f"{theirs} runs another command than {ours}: {' '.join(info.command[1:])}"
        return ""
