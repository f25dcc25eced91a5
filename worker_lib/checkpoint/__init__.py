"""Checkpoints by concern: ``manager`` (a rank's saves and verified loads), the formats
(``flat`` buffers, ``dcp`` and its reader, ``directory`` mode), the tiers (``memory`` and its
``memory_slots``), ``staging`` (host buffers and the copies into them), the ``commit`` every rank
agrees on with its ``marker``, and ``retention``. Imports only ``worker_lib.core`` below it."""
