"""What a rank's heartbeat slot says, as records every layer may use: the hang monitor reads
them, the events and failures name a rank's phase, the results carry an attempt's summary. The
slot file itself (``hangs.board``) is mechanics above this."""

import dataclasses
import enum
from typing import Iterable, Optional

__all__ = ["BeatReading", "BeatSummary", "Phase"]


class Phase(str, enum.Enum):
    """Where a rank is, as its slot shows it."""

    STARTING = "starting"  # no beat yet in this process
    STEPPING = "stepping"  # it has beaten
    PAUSED = "paused"  # inside a save, a load, init(), shutdown() or pause_heartbeat()


@dataclasses.dataclass(frozen=True)
class BeatReading:
    """One rank's slot as read at one moment (times in seconds, CLOCK_MONOTONIC)."""

    beats: int
    step: int
    active_at: float  # the last beat, pause start or pause end; 0.0: never
    paused: bool
    pauses: int
    dump_signal: int
    main_thread: int
    pid: int
    loaded_at: float = 0.0  # when its checkpoint load returned; 0.0: not (yet)
    stop_aware: bool = False  # it calls ft.should_stop(): it can be asked to stop cleanly

    @property
    def phase(self) -> Phase:
        if self.paused:
            return Phase.PAUSED
        return Phase.STEPPING if self.beats > 0 else Phase.STARTING


@dataclasses.dataclass(frozen=True)
class BeatSummary:
    """What an attempt's ranks reported, all of them together."""

    beat: bool  # some rank called ft.heartbeat()
    furthest_step: Optional[int]  # the highest step passed to it; None: none given

    @classmethod
    def of(cls, readings: Iterable[BeatReading]) -> "BeatSummary":
        beaten = [r for r in readings if r.beats > 0]
        steps = [r.step for r in beaten if r.step >= 0]
        return cls(bool(beaten), max(steps) if steps else None)
