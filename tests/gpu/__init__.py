"""CUDA tests. A package, so that a module here (test_warm_spare.py) never clashes with one of the
same name in tests/."""
