"""ftlaunch's supervisor: ``ftlaunch --nproc N train.py`` (see ``launcher.cli``).

Kept free of imports so that ``python -m launcher.orphan_guard.guard`` starts fast.
"""
