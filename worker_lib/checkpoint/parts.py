"""Reading a committed step's parts back: this rank's own part (or why it cannot be read at this
world size), any part verified against the marker's checksum and size, and unpickled with torch's
weights-only loader unless the script trusts its storage."""

from typing import Any, Dict, Optional, Tuple

from worker_lib.checkpoint.commit import OTHER_SIZE, REFUSED, CheckpointError
from worker_lib.checkpoint.marker import RESHARDABLE, CommitMarker, VerifiedPart, opened_verified, part_name
from worker_lib.checkpoint.staging import restore_location
from worker_lib.core.storage import Storage

__all__ = ["PartReader"]


class PartReader:
    """One rank's reads of committed parts. ``trusted``: unpickle anything (else torch's
    weights-only loader and its allow-list)."""

    def __init__(self, storage: Storage, rank: int, world_size: int, trusted: bool) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self._trusted = trusted

    def own(self, marker: CommitMarker) -> Tuple[Dict[str, Any], Optional[str]]:
        """This rank's own part of ``marker``'s step, or why it cannot be read at this world size."""
        if marker.world_size != self.world_size:
            if marker.kind in RESHARDABLE:  # the state fits any world size; RNG streams do not
                return {"rng": None, "state": None}, None
            if marker.kind == "state":  # never a silent fresh start: the way out, on every rank
                return {}, (
                    f"saved by {marker.world_size} ranks {OTHER_SIZE} (now {self.world_size}): relaunch "
                    f"with {marker.world_size} ranks, or save with replicated=True (plain DDP) or "
                    "format='dcp' (sharded) to change sizes"
                )
            return {}, f"saved by {marker.world_size} ranks, now {self.world_size}"
        return self.read(marker, part_name(self.rank))

    def read(self, marker: CommitMarker, name: str) -> Tuple[Any, Optional[str]]:
        """The part ``name`` of ``marker``'s step, verified against its checksum and size."""
        with opened_verified(self.storage, marker.step, name, marker.parts.get(name)) as (part, problem):
            if problem:
                return {}, f"rank {self.rank}: {problem}"
            if part is None:  # never: opened_verified gives the part or what is wrong with it
                raise CheckpointError(f"rank {self.rank}: {name} was neither opened nor found wrong")
            return self._deserialize(name, part)

    def _deserialize(self, name: str, part: VerifiedPart) -> Tuple[Any, Optional[str]]:
        """The part's objects; one the weights-only loader refuses is a problem every rank stops
        at, with the way out. A mapped part's storages are copied out (retention may delete the
        file); a CUDA storage goes to this rank's device (``staging.restore_location``)."""
        import pickle

        import torch

        def load(weights_only: bool) -> Any:
            where = restore_location(copy_cpu=part.mapped)
            return torch.load(part.source, map_location=where, weights_only=weights_only, mmap=part.mapped)

        if self._trusted:
            return load(weights_only=False), None
        try:
            return load(weights_only=True), None
        except pickle.UnpicklingError as err:
            lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch 2.5+
            if not isinstance(part.source, str):  # the bytes read (not mapped): from their start again
                part.source.seek(0)
            unsafe = lister(part.source) if lister is not None else []
            return {}, (
                f"rank {self.rank}: {name} {REFUSED} ({', '.join(unsafe) or str(err).splitlines()[0]}): "
                "allow them with torch.serialization.add_safe_globals([...]) before ft.init(), or, if "
                "only you can write this storage, ft.init(trusted_checkpoints=True)"
            )
