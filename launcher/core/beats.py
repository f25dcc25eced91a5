"""What a rank's heartbeat slot says, as records every layer may use: the hang monitor reads
them, the events and failures name a rank's phase, the results carry an attempt's summary. The
slot file itself (``hangs.board``) is mechanics above this."""

import dataclasses
import enum
from typing import Any, Iterable, List, Optional

from launcher.core.checked import check_record

__all__ = [
    "BeatReading",
    "BeatSummary",
    "CheckpointCounters",
    "CopyReading",
    "Entered",
    "LiveProgress",
    "NodeRow",
    "OwnWork",
    "Phase",
    "ProgressRow",
    "ProgressShare",
]


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
    # the last collective it entered, unchanged for 2 s or more (its sequence number; 0: none;
    # -1: unknown, or it moved since the last read)
    collective: int = -1
    collective_kind: str = ""  # that collective: "all_reduce", ...

    @property
    def phase(self) -> Phase:
        if self.paused:
            return Phase.PAUSED
        return Phase.STEPPING if self.beats > 0 else Phase.STARTING


@dataclasses.dataclass(frozen=True)
class Entered:
    """The last collective a rank entered in the default process group (seq 0: none), as its
    slot said when its attempt ended."""

    seq: int
    kind: str
    node: Optional[int] = None  # None: the only node


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
class OwnWork:
    """One rank's own work as its slot shows it, cumulative in its process: the steps measured,
    their ns from start to the last collective the rank entered, and their whole ns."""

    steps: int = 0
    own_ns: int = 0
    step_ns: int = 0


@dataclasses.dataclass(frozen=True)
class ProgressRow:
    """One running rank as ``ftlaunch status`` shows it (progress.json's ``ranks``)."""

    rank: int
    pid: int
    step: Optional[int]  # None: no beat yet
    silent_for: Optional[float]  # seconds since its last beat or pause edge; None: never active
    phase: str  # a Phase value
    node: Optional[int] = None  # many nodes only
    # Its own work, the mean seconds a step over --straggler-window (None: not measured, or not
    # long enough yet); the stragglers are judged on it where the run is held.
    own_work: Optional[float] = None

    def aged(self, seconds: float) -> "ProgressRow":
        """The same row read ``seconds`` later (a follower's share, as node 0 publishes it)."""
        # max: another host's clock may be ahead of this one's
        silent = None if self.silent_for is None else round(max(0.0, self.silent_for + seconds), 3)
        return dataclasses.replace(self, silent_for=silent)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for name in ("node", "own_work"):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: Any) -> "ProgressRow":
        """Raises ValueError, TypeError or KeyError for anything ``to_json`` does not write."""
        check_record(cls, data, {"step": -1})  # -1: a beat that gave no step
        Phase(data["phase"])
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class CopyReading:
    """--memory-peers: how far this node's copies on other nodes are."""

    newest: int  # the newest step every rank of this node holds in its tier (-1: none yet)
    copied: int  # the newest step every one of its peers holds of it (-1: none yet)
    sent: int  # bytes sent for copies since the supervisor started

    @property
    def lag(self) -> Optional[int]:
        """Steps the copies trail the node's newest snapshot (None: unknown, nothing copied yet)."""
        return self.newest - self.copied if self.copied >= 0 else None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "CopyReading":
        check_record(cls, data, {"newest": -1, "copied": -1})
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class NodeRow:
    """One node's supervisor as node 0 last heard from it (progress.json's ``nodes``)."""

    node: int
    host: Optional[str]
    pid: Optional[int]
    silent_for: float  # seconds since its liveness counter last moved
    lost: bool
    copied: Optional[int] = None  # --memory-peers: the newest step its peers hold of it (None: unknown)
    copy_lag: Optional[int] = None  # steps that trails its newest snapshot (None: unknown)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "NodeRow":
        """Raises ValueError, TypeError or KeyError for anything ``to_json`` does not write."""
        check_record(cls, data)
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class LiveProgress:
    """progress.json: the live attempt's ranks (and, with many nodes, its nodes' supervisors) as
    the supervisor that holds the run last wrote them, for ``ftlaunch status``."""

    attempt: int
    written_at: float  # wall clock
    ranks: List[ProgressRow]
    nodes: Optional[List[NodeRow]] = None  # many nodes only

    def to_json(self) -> dict:
        data: dict = {"attempt": self.attempt, "written_at": self.written_at}
        data["ranks"] = [r.to_json() for r in self.ranks]
        if self.nodes is not None:
            data["nodes"] = [n.to_json() for n in self.nodes]
        return data

    @classmethod
    def from_json(cls, data: Any) -> "LiveProgress":
        """Raises ValueError, TypeError or KeyError for anything ``to_json`` does not write."""
        check_record(cls, data)
        nodes = data.get("nodes")
        return cls(
            **{
                **data,
                "ranks": [ProgressRow.from_json(r) for r in data["ranks"]],
                "nodes": None if nodes is None else [NodeRow.from_json(n) for n in nodes],
            }
        )


@dataclasses.dataclass(frozen=True)
class ProgressShare:
    """A follower's ranks as it shares them with node 0 (its ``progress/<n>`` key)."""

    at: float  # wall clock
    rows: List[ProgressRow]
    copies: Optional[CopyReading] = None  # --memory-peers: its copies on other nodes

    def to_json(self) -> dict:
        data = {"at": self.at, "rows": [r.to_json() for r in self.rows]}
        return {**data, "copies": self.copies.to_json()} if self.copies is not None else data

    @classmethod
    def from_json(cls, data: Any) -> "ProgressShare":
        """Raises ValueError, TypeError or KeyError for anything ``to_json`` does not write."""
        check_record(cls, data)
        copies = CopyReading.from_json(data["copies"]) if data.get("copies") is not None else None
        return cls(data["at"], [ProgressRow.from_json(r) for r in data["rows"]], copies)
