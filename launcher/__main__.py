"""``python -m launcher`` and the ``ftlaunch`` command.

The first thing the entry point does is to record signals instead of raising them: a Ctrl+C
while modules still load (torch, fsspec, libraries whose imports swallow exceptions) is acted on
like one at any later moment, never lost and never a traceback. So this module imports nothing at
its top that is not loaded already (logging compiles regular expressions as it loads: a Ctrl+C
there, before the inbox is open, would be a traceback).
"""

import gc
import os
import sys

_INTERNAL = 70  # ExitCode.INTERNAL; launcher.grammar.errors may be what failed to import
# grpc's C core prints its INFO lines on stderr (a TLS handshake that failed, at every retry of
# gcsfs's bucket look-up against an emulator's HTTP port): the supervisor, its fork server and the
# workers, who inherit it, run at ERROR unless the user chose a level.
_GRPC_LEVEL = ("GRPC_VERBOSITY", "ERROR")


def entry() -> None:
    os.environ.setdefault(*_GRPC_LEVEL)  # before anything loads grpc: it is read once
    try:
        from launcher.process.signals import SignalInbox  # light: os, select, signal

        with SignalInbox() as signals:
            from launcher.cli.main import main

            code = main(signals=signals)
    except KeyboardInterrupt:  # before the inbox was open
        code = 130  # ExitCode.INTERRUPTED_SIGINT: nothing heavy is imported before the inbox
    except Exception:  # a defect of ours: its traceback, and an exit, never a finalization that hangs
        _report_defect(sys.argv[1:])
        code = _INTERNAL
    # Everything is done and closed. The interpreter's finalization is skipped: its last garbage
    # collections would walk torch's objects once more (about half a second), and a helper thread
    # still inside a torch store call (a node 0 that stopped answering) would abort the process
    # when finalization ends it (SIGABRT, seen as exit -6).
    gc.freeze()
    logging = sys.modules.get("logging")  # loaded by now if anything logged (not at the top: see above)
    if logging is not None:
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`ftlaunch status | head`), a closed stream
            pass
    os._exit(int(code))


def _report_defect(args: list) -> None:
    import traceback

    try:
        sys.stderr.write(traceback.format_exc())
        sys.stderr.write(defect_line(args))
    except (OSError, ValueError):
        pass


def defect_line(args: list) -> str:
    """The line after a defect's traceback: what it left behind. ``ftlaunch status`` only reads:
    it stopped no worker and has nothing to resume."""
    from launcher.cli import subcommand_of  # the standard library's os only

    said = f"ftlaunch: internal error (exit {_INTERNAL}): a defect in ftlaunch, please report it with the "
    if subcommand_of(args) == "status":
        return said + "traceback above; `ftlaunch status` only reads the run directory, it changed nothing\n"
    return said + "traceback above; its workers were stopped, and the same command resumes the run\n"


if __name__ == "__main__":
    entry()
