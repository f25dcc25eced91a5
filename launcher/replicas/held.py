"""What a node holds of other nodes' snapshots, in its own tier's ``peers/`` folder (so it goes
where the tier goes: at the supervisor's end, or with its orphan guard):

    peers/ranks_<first>_<count>/copy_<attempt>_<step>/   one node's ranks at one step, whole:
        rank_<r>, rank_<r>.index, rank_<r>.json            each rank's slot files, as its tier had them
        COPY.json                                          who sent it, and each file's size and CRC32

A copy is received into a hidden folder, its checksums compared, COPY.json written, and only then
renamed into place: a copy torn mid-transfer is never seen. The two newest copies of a node's
ranks are kept (the newest may be one step ahead of what every rank agreed), older ones go."""

import dataclasses
import errno
import json
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Dict, List, Tuple

from launcher.replicas.wire import WireError, recv_crc, recv_file

__all__ = ["Copy", "HeldCopies", "NoRoomForCopy", "ranks_key"]

_KEEP = 2
_COPY = re.compile(r"copy_(\d+)_(\d+)")
_NAME = re.compile(r"rank_\d+(\.index|\.json)?")


class NoRoomForCopy(Exception):
    """/dev/shm is full: this node takes no more copies."""


def ranks_key(first: int, count: int) -> str:
    return f"ranks_{first}_{count}"


@dataclasses.dataclass(frozen=True)
class Copy:
    """A whole copy held here: one node's ranks at one step."""

    folder: Path
    attempt: int  # the attempt in which it was sent
    step: int
    source: int  # the node that sent it
    files: Dict[str, Tuple[int, int]]  # name -> (size, crc32)

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.files.values())


class HeldCopies:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def receive(self, sock: socket.socket, header: dict) -> dict:
        """Take one copy whose ``header`` came (``put``): its files' bytes follow, each with its
        CRC32, then a word from the sender that nothing was rewritten under it. The reply."""
        key = ranks_key(int(header["first"]), int(header["count"]))
        attempt, step, source = int(header["attempt"]), int(header["step"]), int(header["source"])
        files = [(str(f["name"]), int(f["size"])) for f in header["files"]]
        if not files or any(not _NAME.fullmatch(name) or size < 0 for name, size in files):
            raise WireError(f"a copy with odd files: {files}")
        where = self.folder / key
        partial = where / f".partial-{uuid.uuid4().hex}"
        try:
            sums = self._take_files(sock, partial, files)
            whole = bool(recv_crc(sock))  # the sender's last word: 1 if its slots held still
            if not whole:
                return {"ok": False, "why": "the slots changed while they were sent"}
            (partial / "COPY.json").write_text(
                json.dumps({"attempt": attempt, "step": step, "source": source, "files": sums})
            )
            final = where / f"copy_{attempt}_{step}"
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise NoRoomForCopy(str(err)) from None
            raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        self._prune(where)
        return {"ok": True}

    def _take_files(self, sock: socket.socket, partial: Path, files: List[Tuple[str, int]]) -> dict:
        partial.mkdir(parents=True, mode=0o700)
        sums = {}
        for name, size in files:
            with open(partial / name, "wb") as out:
                got = recv_file(sock, out, size)
            sent = recv_crc(sock)
            if got != sent:
                raise WireError(f"{name}: checksum {got:08x} received, {sent:08x} sent")
            sums[name] = [size, got]
        return sums

    def copies(self, first: int, count: int) -> List[Copy]:
        """The whole copies of these ranks, newest (attempt, step) first."""
        found = []
        for folder in (self.folder / ranks_key(first, count)).glob("copy_*"):
            named = _COPY.fullmatch(folder.name)
            try:
                said = json.loads((folder / "COPY.json").read_text())
                files = {str(n): (int(s), int(c)) for n, (s, c) in said["files"].items()}
                copy = Copy(folder, int(said["attempt"]), int(said["step"]), int(said["source"]), files)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if named and (copy.attempt, copy.step) == (int(named.group(1)), int(named.group(2))):
                found.append(copy)
        return sorted(found, key=lambda c: (c.attempt, c.step), reverse=True)

    def _prune(self, where: Path) -> None:
        first, count = (int(x) for x in where.name.split("_")[1:])
        for old in self.copies(first, count)[_KEEP:]:
            shutil.rmtree(old.folder, ignore_errors=True)
        for other in self.folder.glob("ranks_*"):  # another layout of these ranks (a resize): stale
            if other != where and _overlaps(other.name, first, count):
                shutil.rmtree(other, ignore_errors=True)


def _overlaps(name: str, first: int, count: int) -> bool:
    try:
        other_first, other_count = (int(x) for x in name.split("_")[1:])
    except ValueError:
        return False
    return other_first < first + count and first < other_first + other_count
