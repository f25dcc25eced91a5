"""CUDA tests (a package, so that its conftest and modules never shadow tests/' own: see conftest.py)."""
