"""The supervisor's own import of torch. torch's C++ side prints its warnings (a store connection
that broke, a wait that timed out) with stack traces of twenty frames; in the supervisor they are
about calls whose failures it handles and reports itself (a node that died, a renewed wait), so
its process loads torch at the error level. TORCH_CPP_LOG_LEVEL is read once, when torch loads:
the variable is set only for that moment, and the workers' environment is the user's (a value the
user set is kept, here too)."""

import os
import sys

__all__ = ["import_torch"]

_LEVEL = "TORCH_CPP_LOG_LEVEL"


def import_torch() -> None:
    """Load torch quietly, unless it is loaded already; call before the first ``import torch``."""
    if "torch" in sys.modules:
        return
    users = os.environ.get(_LEVEL)
    os.environ[_LEVEL] = users or "ERROR"
    try:
        import torch  # noqa: F401 - loaded now, at this level
    finally:
        if users is None:
            del os.environ[_LEVEL]
