"""Node 0's record of who trains at which position (--standby-nodes): positions stay with their
nodes across attempts (and a relaunch of node 0), a standby takes a lost node's, and each change
of hands is said and recorded with the reason the node left."""

from typing import Callable, Dict, List, Mapping, Optional, Sequence

from launcher.core.config import ClusterSection
from launcher.core.events import Decision, NodeReplaced
from launcher.core.layout import Layout, Placed, place_nodes
from launcher.core.records import AttemptEntry
from launcher.core.results import AttemptResult
from launcher.process.kit import NodeKit
from launcher.runs.run import Run

__all__ = ["Places"]


class Places:
    def __init__(self, cluster: ClusterSection, nproc: int, run: Run, kit: NodeKit) -> None:
        self.cluster, self.nproc = cluster, nproc
        self._kit = kit
        # Without standby nodes a node's position is its place in node-rank order, as ever.
        self._positions: Dict[int, int] = _positions_of(run) if cluster.standby else {}
        self._left: Dict[int, str] = {}  # node lost in the last attempt → why
        self._standbys: Optional[int] = None  # standby nodes in the last plan (None: no plan yet)

    def place(self, present: Mapping[int, object]) -> Placed:
        return place_nodes(present, self._positions, min(len(present), self.cluster.nnodes))

    def members(self, members: List[dict], layout: Layout) -> List[dict]:
        """Who holds the attempt, for run.json; with standby nodes, each node's position or that
        it stands by."""
        if not self.cluster.standby:
            return members
        positions = layout.positions()
        return [
            {**m, "position": positions[m["node"]]} if m["node"] in positions else {**m, "standby": True}
            for m in members
        ]

    def left(self, why: Mapping[int, str]) -> None:
        """The nodes that left in the attempt that ended (lost, excluded), and why: what the next
        plan says of them."""
        self._left.update(why)

    def outside(self, ended: AttemptResult, waiting: Callable[[], int]) -> bool:
        """With standby nodes and no standby in the round: whether a node waits outside it (a late
        standby, a node back), to take the lost node's place in a new round."""
        if not self.cluster.standby:
            return False
        try:
            return waiting() > 0
        except Exception:  # noqa: BLE001 - in doubt, the lost node is waited for, as it is said
            return False

    def replacing(self, ended: AttemptResult, standing_by: Sequence[int]) -> None:
        """Node 0's decision after a lost training node with a node to take its place: a standby
        of the round (``standing_by``), or one waiting outside it (a new round, a few seconds)."""
        self._kit.events.emit(Decision(ended.attempt, "replace", ended.cause, 0.0))
        who = (
            f"a standby node takes its place (standing by: node(s) {', '.join(map(str, standing_by))})"
            if standing_by
            else "a node waiting outside the round takes its place in a new round"
        )
        self._kit.say(
            f"attempt {ended.attempt} ended: {ended.cause}; {who}; not a failure, not counted against "
            "--max-failures"
        )

    def planned(self, number: int, placed: Placed, layout: Layout, entry: AttemptEntry) -> None:
        """Record and say which standby took which lost node's place, and when the last standby
        is gone (--standby-nodes)."""
        if not self.cluster.standby:
            return
        said = []
        for position, node, before in placed.took:
            why = self._left.get(before, f"node {before} did not come to the round")
            self._kit.events.emit(NodeReplaced(number, position, node, before, why))
            where = f"GROUP_RANK {position}, {self._ranks(position)}"
            said.append(f"node {node} took node {before}'s place ({where}): {why}")
        if said:
            entry.replaced = "; ".join(said)
            for line in said:
                self._kit.say(f"{line} (a standby: not a failure)")
        if not layout.standby and self._standbys:
            self._kit.say(
                f"no standby node is left (--standby-nodes {self.cluster.standby}): a lost node is "
                "waited for until it is relaunched (it rejoins as a standby)"
            )
        self._standbys = len(layout.standby)
        self._positions, self._left = layout.positions(), {}

    def _ranks(self, position: int) -> str:
        first = position * self.nproc
        return f"RANK {first}" if self.nproc == 1 else f"RANKs {first}-{first + self.nproc - 1}"


def _positions_of(run: Run) -> Dict[int, int]:
    """The positions of the run's last attempt (a relaunched node 0 keeps them): node → position."""
    attempts = run.state.attempts
    if not attempts:
        return {}
    return {m["node"]: m["position"] for m in attempts[-1].nodes if m.get("position") is not None}
