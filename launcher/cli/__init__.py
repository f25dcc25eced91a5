"""The command line: ``ftlaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...`` and ``ftlaunch status``.

Options become LaunchConfig's sections, errors become exit codes, and the modules that only the
command line uses (discovering the machine, the checks before start, the end-of-run summary,
torchrun's PET_* variables) live here, on top of every other layer. Nothing is imported here: the
entry point loads what it needs once its signal inbox is open.
"""
