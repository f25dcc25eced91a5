"""ftlaunch's exit codes and its one exception family."""

import enum
import signal

__all__ = [
    "ExitCode",
    "CheckStopped",
    "FtlaunchError",
    "SignalReceived",
    "JobOver",
    "StandbyReleased",
    "PeerStopped",
    "JoinTimeout",
    "NodeUnhealthy",
    "RunBusy",
    "RunLost",
    "StartFailed",
    "StorageLost",
    "UsageError",
    "exit_code_for_signal",
]


class ExitCode(enum.IntEnum):
    """What ftlaunch's exit status means (docs/reference.md's table is written from this)."""

    SUCCESS = 0  # every rank exited 0 (or the run had already succeeded)
    FAILED = 1  # the failure budget is spent
    USAGE = 2  # bad input, or the run is held by another ftlaunch; no worker was started
    CRASH_LOOP = 3  # attempts kept failing without progress: stopped early
    RUN_LOST = 4  # another ftlaunch took the run over (this one's lease expired): its workers were stopped
    JOIN_TIMEOUT = 5  # many nodes: not every node joined within --join-timeout; relaunch to resume
    JOB_OVER = 6  # many nodes: this node came to a job that had already ended (rendezvous closed)
    STORAGE_LOST = 7  # the run dir answered nothing for longer than the lease: its workers were stopped
    UNHEALTHY = 8  # this node failed its health check (or is excluded): drain or replace it
    INTERNAL = 70  # a defect in ftlaunch (EX_SOFTWARE): the traceback says where; workers were stopped
    INTERRUPTED_SIGHUP = 128 + signal.SIGHUP  # 129
    INTERRUPTED_SIGINT = 128 + signal.SIGINT  # 130
    PREEMPTED = 128 + signal.SIGTERM  # 143: SIGTERM (scheduler preemption, time limit): requeue me


def exit_code_for_signal(signum: int) -> int:
    """The shell's convention: a run ended by signal N exits 128 + N."""
    return 128 + signum


class FtlaunchError(Exception):
    """Base of every error ftlaunch raises on purpose; ``cli.main`` maps it to an exit code."""

    exit_code: int = ExitCode.FAILED


class UsageError(FtlaunchError):
    """Bad input found before any worker started."""

    exit_code = ExitCode.USAGE


class StartFailed(FtlaunchError):
    """An attempt's workers could not be started (its store could not listen, a spawn failed)."""


class RunBusy(UsageError):
    """Another live ftlaunch holds the run."""


class RunLost(FtlaunchError):
    """This supervisor no longer holds its run: another one took it over."""

    exit_code = ExitCode.RUN_LOST


class StorageLost(FtlaunchError):
    """The run dir has not answered for longer than the lease: the run may no longer be ours."""

    exit_code = ExitCode.STORAGE_LOST


class JoinTimeout(FtlaunchError):
    """Many nodes: the others did not all come within --join-timeout."""

    exit_code = ExitCode.JOIN_TIMEOUT


class NodeUnhealthy(FtlaunchError):
    """This node failed its health check before an attempt: it does not join (or restart)."""

    exit_code = ExitCode.UNHEALTHY


class JobOver(FtlaunchError):
    """Many nodes: the job this node came to has ended (its leader closed the rendezvous)."""

    exit_code = ExitCode.JOB_OVER


class StandbyReleased(FtlaunchError):
    """--standby-nodes: the job ended while this node waited outside its round (a late standby, a
    lost node relaunched): it ends as the job did not need it, exit 0, or as a stopped job did
    (``exit_code``: 143 for a preemption, so that it is requeued with the others)."""

    def __init__(self, message: str, exit_code: int = ExitCode.SUCCESS) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SignalReceived(FtlaunchError):
    """A signal (Ctrl+C, SIGTERM, SIGHUP) came before any worker started: ftlaunch stops there."""

    def __init__(self, signum: int, said_as: str = "") -> None:
        """``said_as``: the signal's name as sent (SIGUSR1, the preemption notice, counts as
        SIGTERM)."""
        self.said_as = said_as or signal.Signals(signum).name
        super().__init__(f"interrupted by {self.said_as} before any worker started")
        self.exit_code = exit_code_for_signal(signum)
        self.signum = signum


class CheckStopped(SignalReceived):
    """A signal came while this node's health check ran (the check was killed)."""


class PeerStopped(SignalReceived):
    """Another node got a signal while the nodes met: this one stops as it does (one Ctrl+C stops
    the job)."""

    def __init__(self, node: int, signum: int, said_as: str = "") -> None:
        super().__init__(signum, said_as)
        self.node = node
        self.args = (f"node {node} got {self.said_as} while the nodes were meeting",)
