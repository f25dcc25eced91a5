"""--chaos during an attempt: send the faults the injector finds due, or leave them in the rank's
slot for worker_lib, and tell which failures were their doing. Without --chaos, ``NoChaos``."""

import os
import signal
import time
from typing import Callable, List, Optional

from launcher.chaos.injector import ChaosInjector, Injection, mark_injected, not_landed
from launcher.core.events import ChaosInjected, EventLog
from launcher.core.failures import Failure
from launcher.core.layout import Layout
from launcher.grammar.chaos import ChaosPlan, FaultKind
from launcher.process.node_loss import lose_this_node

__all__ = ["ChaosDriver", "NoChaos", "chaos_for"]


class NoChaos:
    def attempt_started(self, layout: Layout) -> None:
        pass

    def inject(self, attempt: int, group, board, slots) -> None:
        pass

    def mark(self, failures: List[Failure]) -> List[Failure]:
        return failures


class ChaosDriver(NoChaos):
    def __init__(
        self, injector: ChaosInjector, events: EventLog, say: Callable[[str], None], positions: bool = False
    ) -> None:
        self._injector = injector
        self._positions = positions  # --standby-nodes: a node's ranks are its position's, which moves
        self._events = events
        self._say = say
        self._injected: List[Injection] = []  # this attempt's

    def attempt_started(self, layout: Layout) -> None:
        """``layout``: the attempt's; with standby nodes the faults naming a rank follow the rank
        to the node that runs it now (without them, a node's ranks are its own: every_node's)."""
        self._injected = []
        moved = {layout.rank(i) for i in range(layout.nproc)} if self._positions and layout.trains else None
        self._injector.attempt_started(moved)

    def inject(self, attempt: int, group, board, slots) -> None:
        """Send the faults that are due, or leave them in the slot for worker_lib (the next turns
        of the monitor loop see what they did)."""
        for fault in self._injector.look(time.monotonic(), group.running(), slots):
            if fault.kind == FaultKind.KILL_NODE.value:
                self._lose_node(attempt, fault, slots)
            slot = slots.get(fault.rank)
            step = slot.step if slot is not None and slot.beats > 0 and slot.step >= 0 else None
            what = signal.Signals(fault.signum).name if fault.signum else fault.kind
            via = "worker_lib" if fault.request else "signal"
            self._events.emit(ChaosInjected(attempt, fault.fault, what, fault.rank, fault.pid, step, via))
            where = f" at step {step}" if step is not None else ""
            if fault.request:
                board.request_chaos(fault.rank, fault.request)
                self._say(
                    f"chaos: asked rank {fault.rank} (pid {fault.pid}){where} for {what} ({fault.fault})"
                )
                self._injected.append(fault)
                continue
            self._say(f"chaos: {what} to rank {fault.rank} (pid {fault.pid}){where} ({fault.fault})")
            try:
                os.kill(fault.pid, fault.signum)
            except ProcessLookupError:
                continue  # it died on its own first: then its failure is its own
            self._injected.append(fault)

    def _lose_node(self, attempt: int, fault: Injection, slots) -> None:
        """kill-node: said and recorded here first (nothing of this node will speak after), then
        its whole tree and this supervisor SIGKILLed: never returns."""
        steps = [s.step for s in slots.values() if s.beats > 0 and s.step >= 0]
        step = max(steps) if steps else None
        pid = os.getpid()
        self._events.emit(ChaosInjected(attempt, fault.fault, "SIGKILL", -1, pid, step, "signal"))
        where = f" at step {step}" if step is not None else ""
        self._say(
            f"chaos: this node is lost for good{where}: SIGKILL to its supervisor (pid {pid}) and every "
            f"process it started ({fault.fault})"
        )
        lose_this_node()

    def mark(self, failures: List[Failure]) -> List[Failure]:
        """The attempt is over: its failures that were this fault's doing are marked, and a request
        its rank never carried out is asked again in the next attempt (a fault of at=save or
        at=commit lands once, whatever stopped its rank first)."""
        marked = mark_injected(failures, self._injected)
        for request in not_landed(marked, self._injected):
            if not failures:  # the attempt ended well, the fault nowhere: the script never got there
                self._say(
                    f"chaos: {request.fault} never landed: rank {request.rank} did not reach it before it "
                    "exited (at=save and at=commit act inside worker_lib's checkpoint saves; "
                    "raise and sleep at its heartbeats)"
                )
                continue
            self._say(
                f"chaos: rank {request.rank} was stopped before it carried out {request.fault}; asked again"
            )
            self._injector.ask_again(request)
        return marked


def chaos_for(
    plan: Optional[ChaosPlan],
    every_node: Layout,
    events: EventLog,
    say: Callable[[str], None],
    positions: bool = False,
) -> NoChaos:
    """``every_node``: this node's ranks with every node present (an elastic job's smaller
    attempts number them otherwise; --chaos names ranks of the full job), and its node rank,
    which a node's fault names."""
    if plan is None:
        return NoChaos()
    local = {every_node.rank(i) for i in range(every_node.nproc)}
    injector = ChaosInjector(plan, every_node.world_size, local, time.monotonic(), every_node.node)
    return ChaosDriver(injector, events, say, positions)
