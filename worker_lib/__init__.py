"""What training scripts import: ``import worker_lib as ft``.

Importing this package must stay cheap (no torch at import time): workers that only beat
or read their environment should not pay for torch.
"""

from worker_lib import contract
from worker_lib.backend import choose_backend

__all__ = ["contract", "choose_backend"]
