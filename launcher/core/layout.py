"""Where one node's ranks sit in one attempt: which nodes hold the attempt, in which position, and
so which global ranks this node runs. Without standby nodes a node's position is its place among
the attempt's nodes in node-rank order (torchrun's GROUP_RANK); with --standby-nodes positions are
sticky (``place_nodes``): a node keeps its position while it is in the job, and a standby takes a
lost node's."""

import dataclasses
from typing import Dict, Iterable, Mapping, Tuple

__all__ = ["Layout", "Placed", "place_nodes"]


@dataclasses.dataclass(frozen=True)
class Layout:
    nodes: Tuple[int, ...]  # the training nodes in position order: nodes[p] has GROUP_RANK p
    node: int  # this node's --node-rank (one of ``nodes`` or ``standby``)
    nproc: int  # ranks per node
    standby: Tuple[int, ...] = ()  # the nodes of the attempt that stand by, running no rank

    def __post_init__(self) -> None:
        if self.node not in self.nodes and self.node not in self.standby:
            raise ValueError(f"node {self.node} is not one of the attempt's nodes {list(self.nodes)}")
        if set(self.nodes) & set(self.standby):
            raise ValueError(f"nodes {sorted(set(self.nodes) & set(self.standby))} both train and stand by")

    @classmethod
    def every_node(cls, nnodes: int, node: int, nproc: int) -> "Layout":
        """Every node of the job, as a job of a fixed node count always has. A standby node
        (``node`` >= ``nnodes``) as if it held the last position: what it warms up for."""
        if node < nnodes:
            return cls(tuple(range(nnodes)), node, nproc)
        return cls((*range(nnodes - 1), node), node, nproc)

    @property
    def trains(self) -> bool:
        """This node runs ranks in the attempt (else it stands by)."""
        return self.node in self.nodes

    @property
    def group_rank(self) -> int:
        """This node's position among the attempt's nodes (torchrun's GROUP_RANK)."""
        if not self.trains:
            raise ValueError(f"node {self.node} stands by: it has no GROUP_RANK")
        return self.nodes.index(self.node)

    @property
    def group_world_size(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.nproc * len(self.nodes)

    def rank(self, local_rank: int) -> int:
        return self.group_rank * self.nproc + local_rank

    def positions(self) -> Dict[int, int]:
        """node → its position, for the training nodes."""
        return {node: position for position, node in enumerate(self.nodes)}

    def describe(self) -> str:
        """For the log: 'nodes 0, 2 (4 ranks)', and the standby nodes."""
        said = f"node(s) {', '.join(map(str, self.nodes))} ({self.world_size} ranks)"
        if self.standby:
            said += f", node(s) {', '.join(map(str, self.standby))} standing by"
        return said


@dataclasses.dataclass(frozen=True)
class Placed:
    """``place_nodes``' answer: who trains where, who stands by, and whose place changed hands."""

    nodes: Tuple[int, ...]  # position order
    standby: Tuple[int, ...]  # ascending
    took: Tuple[Tuple[int, int, int], ...] = ()  # (position, standby now, node before): a replacement


def place_nodes(present: Iterable[int], before: Mapping[int, int], size: int) -> Placed:
    """The positions of an attempt with ``size`` training positions on the ``present`` nodes.
    ``before``: node → position of the attempt before (empty: a fresh start, where the lowest node
    ranks train in node-rank order). A present node keeps its position; a free one goes to the
    lowest present node without one (a standby, or a node that came back: it never displaces one
    that trains). Node 0 always holds position 0: it leads."""
    present = sorted(set(present))
    if size > len(present) or size < 1:
        raise ValueError(f"{size} training position(s) for {len(present)} node(s) present")
    at: Dict[int, int] = {}  # position → node
    for node, position in before.items():
        if node in present and position < size and position not in at:
            at[position] = node
    placed = set(at.values())
    waiting = [n for n in present if n not in placed]
    for position in range(size):
        if position not in at:
            at[position] = waiting.pop(0)
    nodes = tuple(at[p] for p in range(size))
    if nodes[0] != 0:
        raise ValueError(f"node 0 must hold position 0 (it leads), got nodes {list(nodes)}")
    previous = {position: node for node, position in before.items()}
    took = tuple(  # a node that trained before and only moved (an elastic job shrank) took no place
        (p, node, previous[p])
        for p, node in enumerate(nodes)
        if p in previous and previous[p] != node and node not in before
    )
    return Placed(nodes, tuple(waiting), took)
