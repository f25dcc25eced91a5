"""The command line: ``ftlaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...`` and ``ftlaunch status``.

Options become LaunchConfig's sections, errors become exit codes, and the modules that only the
command line uses (discovering the machine, the checks before start, the end-of-run summary,
torchrun's PET_* variables) live here, on top of every other layer. Only the standard library's
``os`` is imported here: the entry point asks ``subcommand_of`` even after a defect.
"""

import os
from typing import Dict, Optional, Sequence

# Each subcommand and where it lives (imported only when asked for: status reads storage).
SUBCOMMANDS: Dict[str, str] = {"status": "launcher.cli.status:status"}


def subcommand_of(args: Sequence[str]) -> Optional[str]:
    """The subcommand the first word names; None for a launch, also where a file of that name is
    in the working directory (a script named ``status`` runs, as ``ftlaunch ./status`` does)."""
    first = args[0] if args else None
    return first if first in SUBCOMMANDS and not os.path.exists(first) else None
