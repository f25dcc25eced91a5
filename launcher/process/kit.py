"""What every part of one node's agent shares."""

import dataclasses

from launcher.core.events import EventLog, Say
from launcher.process.signals import SignalInbox

__all__ = ["NodeKit"]


@dataclasses.dataclass(frozen=True)
class NodeKit:
    """The node's event log, its signal inbox, and its console line (``say``)."""

    events: EventLog
    signals: SignalInbox
    say: Say
