"""Where one node's ranks sit in one attempt: which nodes hold the attempt and so which global
ranks this node runs. Fixed for a job of a fixed node count; with --nnodes MIN:MAX each attempt
has its own, and ranks are numbered densely over the nodes present, in node-rank order."""

import dataclasses
from typing import Tuple

__all__ = ["Layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    nodes: Tuple[int, ...]  # the node ranks that hold the attempt, ascending
    node: int  # this node's --node-rank (one of ``nodes``)
    nproc: int  # ranks per node

    def __post_init__(self) -> None:
        if self.node not in self.nodes:
            raise ValueError(f"node {self.node} is not one of the attempt's nodes {list(self.nodes)}")

    @classmethod
    def every_node(cls, nnodes: int, node: int, nproc: int) -> "Layout":
        """Every node of the job, as a job of a fixed node count always has."""
        return cls(tuple(range(nnodes)), node, nproc)

    @property
    def group_rank(self) -> int:
        """This node's place among the attempt's nodes (torchrun's GROUP_RANK)."""
        return self.nodes.index(self.node)

    @property
    def group_world_size(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.nproc * len(self.nodes)

    def rank(self, local_rank: int) -> int:
        return self.group_rank * self.nproc + local_rank

    def describe(self) -> str:
        """For the log: 'nodes 0, 2 (4 ranks)'."""
        return f"node(s) {', '.join(map(str, self.nodes))} ({self.world_size} ranks)"
