"""What a rank's heartbeat slot says, as records every layer may use: the hang monitor reads
them, the events and failures name a rank's phase, the results carry an attempt's summary. The
slot file itself (``hangs.board``) is mechanics above this."""

import dataclasses
import enum
from typing import Any, Dict, Iterable, Optional

__all__ = ["BeatReading", "BeatSummary", "CheckpointCounters", "NodeRow", "Phase", "ProgressRow"]


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
    loaded_step: int = -1  # the step its load returned (-1: none, a fresh start)
    loaded_tier: int = 0  # where from: worker_lib.core.contract's LOADED_NONE, _STORAGE or _MEMORY

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


@dataclasses.dataclass(frozen=True)
class CheckpointCounters:
    """One rank's checkpoint counters as its slot shows them, cumulative in its process."""

    saves_memory: int = 0
    save_memory_ns: int = 0
    saves_storage: int = 0
    save_storage_ns: int = 0
    commits: int = 0  # commit markers it wrote (the job's rank 0 writes them all)
    commit_ns: int = 0  # from each save's write to its marker
    load_ns: int = 0  # how long its load took (the tier is the reading's ``loaded_tier``)


@dataclasses.dataclass(frozen=True)
class ProgressRow:
    """One running rank as ``ftlaunch status`` shows it (progress.json's ``ranks``)."""

    rank: int
    pid: int
    step: Optional[int]  # None: no beat yet
    silent_for: Optional[float]  # seconds since its last beat or pause edge; None: never active
    phase: str  # a Phase value
    node: Optional[int] = None  # many nodes only

    def aged(self, seconds: float) -> "ProgressRow":
        """The same row read ``seconds`` later (a follower's share, as node 0 publishes it)."""
        silent = None if self.silent_for is None else round(self.silent_for + seconds, 3)
        return dataclasses.replace(self, silent_for=silent)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        if self.node is None:
            del data["node"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ProgressRow":
        fields: Dict[str, Any] = {name: data.get(name) for name in cls.__dataclass_fields__}
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class NodeRow:
    """One node's supervisor as node 0 last heard from it (progress.json's ``nodes``)."""

    node: int
    host: Optional[str]
    pid: Optional[int]
    silent_for: float  # seconds since its liveness counter last moved
    lost: bool

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "NodeRow":
        fields: Dict[str, Any] = {name: data.get(name) for name in cls.__dataclass_fields__}
        return cls(**fields)
