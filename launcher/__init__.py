"""ftlaunch's supervisor: ``ftlaunch --nproc N train.py`` (see ``launcher.cli``).

Kept free of imports so that ``python -m launcher.process.orphan_guard`` starts fast.
"""
