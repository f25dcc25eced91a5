"""Which nodes hold a node's copies (pure): the next --memory-peers training nodes after it in
position order, round the ring; where the job spans several hosts, never one on its own host (a
host lost takes all its nodes' memory)."""

from typing import Mapping, Sequence, Tuple

__all__ = ["peers_of"]


def peers_of(node: int, nodes: Sequence[int], hosts: Mapping[int, str], count: int) -> Tuple[int, ...]:
    """``nodes``: the training nodes in position order; ``hosts``: node -> its host."""
    if node not in nodes or count <= 0:
        return ()
    at = list(nodes).index(node)
    ring = [nodes[(at + step) % len(nodes)] for step in range(1, len(nodes))]
    spans_hosts = len({hosts.get(n, "") for n in nodes}) > 1
    if spans_hosts:
        ring = [n for n in ring if hosts.get(n, "") != hosts.get(node, "")]
    return tuple(ring[:count])
