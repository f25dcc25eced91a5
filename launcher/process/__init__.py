"""Process mechanics: plan, spawn, watch and stop worker groups; no policy here.

Kept free of imports, like ``launcher``: the orphan guard runs as ``python -m
launcher.process.orphan_guard`` and must start fast.
"""
