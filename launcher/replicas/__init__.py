"""Memory snapshots copied to other nodes (issue 51): each node's supervisor sends its ranks'
newest whole snapshot to --memory-peers other nodes over TCP (``sender``), each node holds what
it is sent (``held``, served by ``server``), and a node whose ranks have no snapshot of their own
(a standby that took a lost node's place, a node relaunched) fetches theirs before its workers
start (``restore``), so their vote finds it in the node's own tier."""
