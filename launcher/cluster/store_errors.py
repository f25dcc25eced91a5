"""The one place that says which errors of a follower's call to node 0's store mean node 0 is gone
(the follower then waits for it up to --join-timeout); any other error is a defect (exit 70)."""

from launcher.cluster.deadline_store import StoreTimeout

__all__ = ["leader_gone", "what_failed"]

# A plain RuntimeError from a store (no type of torch's own) names the failure in its message.
_GONE_WORDS = (
    "connection reset",
    "broken pipe",
    "connection refused",
    "connection was likely closed",
    "failed to recv",
    "timed out",
    "timeout",
)


def leader_gone(err: BaseException) -> bool:
    """By type where there is one: torch's DistError family, RendezvousConnectionError, our
    StoreTimeout, and the OS's connection errors and timeouts."""
    if isinstance(err, (StoreTimeout, ConnectionError, TimeoutError)):
        return True
    if isinstance(err, _torch_store_errors()):
        return True
    return isinstance(err, RuntimeError) and any(word in str(err).lower() for word in _GONE_WORDS)


def what_failed(err: BaseException) -> str:
    """The store's own error: c10d's rendezvous hides it behind 'see inner exception'."""
    inner = err.__cause__ if err.__cause__ is not None else err
    return f"{type(inner).__name__}: {inner}"


def _torch_store_errors() -> tuple:
    """Imported only here: a store error means torch is already imported (seconds otherwise)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    return (DistError, RendezvousConnectionError)
