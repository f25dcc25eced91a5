"""Seen from outside: the run's metrics (Prometheus text on a port or in a file), the picture of
a run, and the slots' readings turned into the events both are drawn from."""
