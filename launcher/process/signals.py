"""Signals as events for the supervisor's loop.

SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session; left ignored under ``nohup``) are
recorded, not acted on in the handler; SIGCHLD only wakes the loop. The preemption notice
(SIGUSR1 by default, what ``sbatch --signal=B:USR1@120`` forwards) is recorded as SIGTERM: the
same stop at an agreed step, the same exit 143 that asks the job to be requeued. All of them
write to one wakeup pipe, so the loop sleeps in ``select`` and still notices a dead worker or a
Ctrl+C at once instead of at its next poll.
"""

import os
import select
import signal
from typing import List, Optional

from launcher.grammar.errors import SignalReceived

__all__ = ["SignalInbox"]

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Both are caught from the start (the option that picks one is read later): left at their default
# action, either would kill the supervisor and leave its workers to the orphan guard.
NOTICE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


class SignalInbox:
    """Install with ``open()`` (main thread only), undo with ``close()``; or ``with SignalInbox()``."""

    def __init__(self) -> None:
        self.received: List[int] = []
        # How many of ``received`` the attempt has acted on (it stopped its ranks for them): a
        # wait after the attempt (a report, a verdict) ends for any later one, including one that
        # came between the attempt's end and the wait's start.
        self.answered = 0
        self.preempt_signal: int = signal.SIGUSR1  # the one of NOTICE_SIGNALS that means "preempted"
        self._noticed_at: Optional[int] = None  # where in ``received`` the notice was recorded
        self._read_fd = self._write_fd = -1
        self._previous: dict = {}
        self._previous_wakeup = -1

    @property
    def first(self) -> Optional[int]:
        return self.received[0] if self.received else None

    @property
    def is_open(self) -> bool:
        return self._read_fd >= 0

    def open(self) -> None:
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in _HANDLED + NOTICE_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # `nohup ftlaunch ...`: a closed terminal is to be ignored (the workers inherit it)
            self._previous[sig] = signal.signal(sig, self._record)
        self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)

    def __enter__(self) -> "SignalInbox":
        self.open()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Put the previous handlers back; closing twice, or unopened, does nothing."""
        if not self.is_open:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup)
        for fd in (self._read_fd, self._write_fd):
            os.close(fd)
        self._read_fd = self._write_fd = -1

    def answer_first(self) -> None:
        """The attempt stops its ranks for the first signal (if one came)."""
        self.answered = max(self.answered, min(1, len(self.received)))

    def raise_if_received(self) -> None:
        """Before any worker started, a signal simply ends the launch."""
        if self.received:
            raise SignalReceived(self.received[0], self.name(0))

    def name(self, index: int) -> str:
        """What to call ``received[index]``: its name, or the preemption notice's own name when
        that is what was recorded as SIGTERM there."""
        if index == self._noticed_at:
            return f"{signal.Signals(self.preempt_signal).name} (the preemption notice)"
        return signal.Signals(self.received[index]).name

    def name_of(self, signum: int) -> str:
        """What to call the first ``signum`` received (a signal that ended the run)."""
        if signum not in self.received:
            return signal.Signals(signum).name
        return self.name(self.received.index(signum))

    def wake(self) -> None:
        """From another thread: end the loop's current ``wait`` at once (news it must act on)."""
        try:
            os.write(self._write_fd, b"\0")
        except OSError:  # closed, or full: the loop wakes anyway
            pass

    def wait(self, timeout: float) -> None:
        """Sleep until a signal arrives (a child's exit included) or ``timeout`` passes."""
        ready, _, _ = select.select([self._read_fd], [], [], timeout)
        if ready:
            try:
                while os.read(self._read_fd, 512):
                    pass
            except BlockingIOError:
                pass

    def _record(self, signum: int, _frame: object) -> None:
        if signum in NOTICE_SIGNALS:
            # SLURM may deliver one notice twice (to the step, and forwarded by the batch
            # script): a repeat is the same request, not the "second signal" that cuts the
            # grace period short. The other notice signal is ignored.
            if signum != self.preempt_signal or self._noticed_at is not None:
                return
            self._noticed_at = len(self.received)
            signum = signal.SIGTERM
        self.received.append(signum)
