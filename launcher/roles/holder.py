"""What the only node and node 0 of many share: they hold the run (run.json, its lease and
checkpoints), host the workers' store, and decide with the restart policy."""

import dataclasses
import time
from typing import List, Optional, Tuple

from launcher.core.events import Decision
from launcher.core.failures import HangFailure, NodeLostFailure
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.policy import RestartPolicy, Verdict
from launcher.core.records import AttemptEntry
from launcher.core.results import AttemptResult, RunResult, ended_by_signal, meeting_stopped
from launcher.grammar.errors import ExitCode, FtlaunchError, SignalReceived, StartFailed
from launcher.hangs.culprit import hang_culprit
from launcher.process.attempt_store import AttemptStore, StoreHost, host_here
from launcher.process.kit import NodeKit
from launcher.process.waiting import Wait
from launcher.roles.role import Conclusion, NodeRole, in_attempt
from launcher.runs.checkpoints import NewestCheckpoint
from launcher.runs.run import Run

__all__ = ["RunHolder"]


class RunHolder(NodeRole):
    """``store_at``: --master-addr and --master-port, where each attempt's workers' store
    listens; ``injectable``: --chaos may inject failures (what the policy needs to know ahead)."""

    def __init__(
        self,
        run: Run,
        kit: NodeKit,
        policy: RestartPolicy,
        store_at: Tuple[str, int],
        injectable: bool = False,
        store_host: StoreHost = host_here,
    ) -> None:
        self._store_at = store_at
        self._injectable = injectable
        self._store_host = store_host
        self.run = run
        self._kit = kit
        self._events, self._signals, self._say = kit.events, kit.signals, kit.say
        self._policy = policy
        self._store: Optional[AttemptStore] = None
        self._entry: Optional[AttemptEntry] = None  # the attempt in progress, in run.json
        self._newest: Optional[NewestCheckpoint] = None  # listed once the fork server warms up

    @property
    def entry(self) -> AttemptEntry:
        """The attempt in progress, as run.json records it."""
        return in_attempt(self._entry, "run.json entry")

    @property
    def store(self) -> AttemptStore:
        """The attempt's workers' store."""
        return in_attempt(self._store, "workers' store")

    # -- the attempt's records and store --------------------------------------------------------

    def _open_attempt(self, members: Optional[List[dict]], world_size: int) -> int:
        """Record the attempt (of ``world_size`` ranks) in run.json and open its workers' store;
        returns its number."""
        number = self.run.state.next_attempt
        if self.run.checkpoints.world_size != world_size:  # an elastic job's size changed
            self.run.checkpoints.world_size, self._newest = world_size, None
        if self._newest is None:
            self._newest = self.run.newest_checkpoint()
        self._entry = self.run.attempt_started(number, self._newest.step, members, world_size)
        self._store = self._open_store()
        return number

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def _open_store(self) -> AttemptStore:
        address, port = self._store_at
        try:
            return AttemptStore(address, port, self._store_host)
        except OSError as err:
            where = f"{address}:{port}"
            message = f"cannot listen on {where} for the workers' store: {err.strerror or err}"
            raise StartFailed(message) from None

    def _with_culprit(self, result: AttemptResult) -> AttemptResult:
        """A hang: who never entered the collective every other rank waits in, from every rank's
        last collective (every node's), said once the attempt's end is known."""
        if not isinstance(result.root_cause, HangFailure):
            return result
        culprit = hang_culprit(result.collectives)
        if culprit:
            self._say(f"attempt {result.attempt}: {culprit}")
        return dataclasses.replace(result, culprit=culprit)

    def _record_end(self, result: AttemptResult) -> None:
        self._newest = self.run.newest_checkpoint()  # what this attempt left is where the next starts
        self.run.attempt_ended(
            self.entry, result.outcome, result.failures, self._newest, result.beats, result.lived
        )

    def not_started(self, error: Exception) -> None:
        self._close_store()
        if self._entry is not None:
            self.run.attempt_not_started(self._entry)

    # -- deciding --------------------------------------------------------------------------------

    def may_restart(self, local: AttemptResult) -> bool:
        """Whether the policy may restart after this node's attempt as it ends (asked by the
        attempt's link, before the group stops)."""
        if local.outcome is not AttemptOutcome.FAILED:
            return local.outcome.may_restart
        history = self.run.state.history()
        return self._policy.may_restart_a_failure(history, time.time(), self._injectable)

    def decide(
        self, concluded: Conclusion, attempts: List[AttemptResult]
    ) -> Tuple[Optional[RunResult], float]:
        result = concluded.result
        ended = RunStatus.ended_by(result.outcome)
        if result.outcome is AttemptOutcome.SUCCEEDED:
            return RunResult(ExitCode.SUCCESS, ended, attempts, "every rank exited 0"), 0.0
        by_attempt = result.outcome.stopped_by_signal
        signum = result.signum if by_attempt else self._signals.first
        if signum is not None:  # a signal while the attempt ended: no restart
            name = result.signal_name if by_attempt and result.signal_name else self._signals.name_of(signum)
            return ended_by_signal(signum, attempts, said_as=name), 0.0
        number = result.attempt
        if result.outcome is AttemptOutcome.RESIZED:  # not a failure: no budget, no backoff
            why = f"the job's nodes changed: {result.cause}"
            self._events.emit(Decision(number, "resize", why, 0.0))
            self._say(f"attempt {number} ended: {why}; restarting on the nodes present (not a failure)")
            return None, 0.0
        if result.outcome is AttemptOutcome.NODE_LOST:  # a supervisor, not the workers: no budget
            self._events.emit(Decision(number, "node_lost", result.cause, 0.0))
            # A node that only stalled runs again by itself; a dead supervisor has to be relaunched.
            dead = any(isinstance(f, NodeLostFailure) and not f.stalled for f in result.failures)
            relaunch = " (a lost node's ftlaunch must be relaunched)" if dead else ""
            self._say(
                f"attempt {number} ended: {result.cause}; not a worker failure (not counted against "
                f"--max-failures): the job restarts once every node is back in the rendezvous{relaunch}"
            )
            return None, 0.0
        decision = self._policy.after_failure(self.run.state.history(), time.time())
        self._events.emit(Decision(number, decision.verdict.value, decision.reason, decision.delay))
        self._say(f"attempt {number} failed: {result.describe_cause()}")
        if decision.verdict is Verdict.CRASH_LOOP:
            reason = f"{decision.reason} (the last: {self.entry.progress_evidence})"
            return RunResult(ExitCode.CRASH_LOOP, ended, attempts, reason), 0.0
        if not decision.restart:
            return RunResult(ExitCode.FAILED, ended, attempts, decision.reason), 0.0
        wait = f"; waiting {decision.delay:g} s first (backoff)" if decision.delay else ""
        self._say(f"restarting the group ({decision.reason}){wait}")
        return None, decision.delay

    def ended_waiting(self, error: FtlaunchError, attempts: List[AttemptResult]) -> RunResult:
        if isinstance(error, SignalReceived):
            return ended_by_signal(error.signum, attempts, meeting_stopped(error), said_as=error.said_as)
        # --join-timeout, or this node unhealthy: nothing is lost, the same command resumes the run
        return RunResult(ExitCode(error.exit_code), RunStatus.STOPPED, attempts, str(error))

    def pause(self, seconds: float) -> None:
        """Wait between attempts, keeping the run's lease; a signal ends the wait."""
        wait = Wait(seconds, self._signals, since=0, look=1.0)
        while not wait.expired:
            try:
                wait.check_signals()  # one that came before the pause ends it too
                wait.pause()
            except SignalReceived:
                return  # the meeting that follows answers it
            self.run.keep_alive(time.time())
