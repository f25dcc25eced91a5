"""``python -m launcher`` and the ``ftlaunch`` command.

The entry point imports the CLI inside its own ``try``: a Ctrl+C while modules are still loading
ends in exit 130 like one at any later moment, never in a traceback.
"""

import sys


def entry() -> None:
    try:
        from launcher.cli import main

        code = main()
    except KeyboardInterrupt:
        code = 130  # ExitCode.INTERRUPTED_SIGINT; nothing else is imported before the try
    sys.exit(int(code))


if __name__ == "__main__":
    entry()
