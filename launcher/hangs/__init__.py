"""Hang detection: the heartbeat board, pure deadlines, the monitor that applies them, stack dumps."""
