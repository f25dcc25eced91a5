"""Every random number generator a training step may draw from, captured and restored, so a
resumed run continues the same random sequence as a run that never stopped."""

import random
import sys
from typing import Any, Dict

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> Dict[str, Any]:
    import torch

    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:  # only if the script uses numpy: never import it for nothing
        name, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        # As a tensor, not a numpy array: torch's weights-only loader reads it back without help.
        state["numpy"] = (
            name,
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
