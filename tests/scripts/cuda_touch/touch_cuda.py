"""A library that touches CUDA when it is imported, as ``TOUCH_CUDA`` says:

- ``query``: ``torch.cuda.is_available()`` and ``device_count()``, as frameworks do to pick a
  device. On a GPU, ``is_available`` initializes the CUDA driver (``cuInit``) without torch
  counting CUDA as initialized, and a process forked after that cannot use CUDA.
- ``init``: ``torch.cuda.init()``, torch's own CUDA initialization (a GPU only).

It lives outside the script's folder and is found through PYTHONPATH, as an installed library is;
a worker imports it after the fork, or the fork server does before any fork with --preload."""

import os

import torch

HOW = os.environ.get("TOUCH_CUDA", "query")
if HOW == "query":
    AVAILABLE, COUNT = torch.cuda.is_available(), torch.cuda.device_count()
elif HOW == "init":
    torch.cuda.init()
else:
    raise ValueError(f"TOUCH_CUDA must be query or init, not {HOW!r}")
