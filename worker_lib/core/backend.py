"""The one place where the collective backend is chosen."""

__all__ = ["BACKENDS", "choose_backend"]

BACKENDS = ("auto", "nccl", "gloo")


def choose_backend(requested: str, gpu_count: int) -> str:
    """Resolve "auto" to nccl when GPUs are visible, else gloo; pass explicit choices through."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r} (choose from {', '.join(BACKENDS)})")
    if requested == "auto":
        return "nccl" if gpu_count > 0 else "gloo"
    return requested
