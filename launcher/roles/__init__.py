"""The node's role in the run: the only node, node 0 of many (the leader), or a follower."""
