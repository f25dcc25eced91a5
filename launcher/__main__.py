"""``python -m launcher`` and the ``ftlaunch`` command.

The first thing the entry point does is to record signals instead of raising them: a Ctrl+C
while modules still load (torch, fsspec, libraries whose imports swallow exceptions) is acted on
like one at any later moment, never lost and never a traceback.
"""

import gc
import sys


def entry() -> None:
    try:
        from launcher.process.signals import SignalInbox  # light: os, select, signal

        with SignalInbox() as signals:
            from launcher.cli import main

            code = main(signals=signals)
    except KeyboardInterrupt:  # before the inbox was open
        code = 130  # ExitCode.INTERRUPTED_SIGINT: nothing heavy is imported before the inbox
    # Everything is done: the interpreter's last garbage collections need not walk torch's
    # objects one more time (about half a second once the supervisor has imported torch).
    gc.freeze()
    sys.exit(int(code))


if __name__ == "__main__":
    entry()
