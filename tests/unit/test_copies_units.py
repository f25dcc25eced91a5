"""Memory snapshots copied to other nodes (issue 51), piece by piece over real loopback sockets
and real files: the sender, a node's copy server, the restore, and the peer choice."""

import json
import os
import socket
import threading
import time
import zlib
from pathlib import Path

import pytest
from helpers import tiny_tmpfs, until

from launcher.replicas.held import HeldCopies
from launcher.replicas.peers import peers_of
from launcher.replicas.restore import needs_restore, restore
from launcher.replicas.sender import Duty, Sender
from launcher.replicas.server import CopyServer
from launcher.replicas.wire import connect, recv_json, send_crc, send_json

LOOPBACK = ("127.0.0.1", "127.0.0.1")  # bound and reached at


def _slot(tier: Path, rank: int, slot: int, step: int, data: bytes, world_size: int = 4) -> None:
    """A slot as worker_lib writes it: data, index, and the record last."""
    index = f"index of {rank}@{step}".encode()
    (tier / f"rank_{rank}.{slot}").write_bytes(data)
    (tier / f"rank_{rank}.{slot}.index").write_bytes(index)
    record = {
        "step": step,
        "kind": "parts",
        "world_size": world_size,
        "size": len(data),
        "index_size": len(index),
        "metrics": {},
    }
    tmp = tier / f"rank_{rank}.{slot}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(tier / f"rank_{rank}.{slot}.json")


@pytest.fixture
def nodes(tmp_path):
    """Three nodes' tiers; node 1 and 2 serve copies."""
    tiers = [tmp_path / f"tier{n}" for n in range(3)]
    for tier in tiers:
        tier.mkdir()
    said = []
    servers = {n: CopyServer(LOOPBACK, HeldCopies(tiers[n] / "peers"), said.append) for n in (1, 2)}
    yield tiers, servers, said
    for server in servers.values():
        server.close()


def test_a_nodes_newest_whole_step_reaches_its_peer_and_restores_byte_for_byte_elsewhere(nodes):
    tiers, servers, said = nodes
    data = {2: os.urandom(3 << 20), 3: os.urandom(1 << 20)}
    for rank in (2, 3):
        _slot(tiers[0], rank, 0, 5, b"older" * 10)
        _slot(tiers[0], rank, 1, 6, data[rank])
    sender = Sender(tiers[0], node=0, rate=0, say=said.append)
    try:
        sender.assign(Duty(attempt=3, first=2, count=2, peers=((1, servers[1].address),)))
        until(lambda: servers[1].held.copies(2, 2), timeout=10)
        until(lambda: sender.lag() == {1: 0}, timeout=10)  # its answer follows the copy
    finally:
        sender.close()
    (copy,) = servers[1].held.copies(2, 2)
    assert (copy.attempt, copy.step, copy.source) == (3, 6, 0)
    assert needs_restore(tiers[2], 2, 2)
    holders = [(1, servers[1].address), (2, servers[2].address)]
    assert restore(tiers[2], 2, 2, 2, holders)[0] is None  # copies of attempt 3 only
    restored, problems = restore(tiers[2], 2, 2, 3, holders)
    assert problems == [] and (restored.step, restored.holder, restored.source) == (6, 1, 0)
    for rank in (2, 3):
        assert (tiers[2] / f"rank_{rank}.0").read_bytes() == data[rank]
        sent = json.loads((tiers[0] / f"rank_{rank}.1.json").read_text())
        restored_record = json.loads((tiers[2] / f"rank_{rank}.0.json").read_text())
        assert restored_record == {**sent, "origin": "node 1's copy of node 0"}  # the rank's log says it
    assert not needs_restore(tiers[2], 2, 2)
    assert [p.name for p in tiers[2].iterdir() if p.name.startswith(".")] == []
    assert said == []


def _put_header(files) -> dict:
    """A put of rank 0's step 7 (of attempt 0, from node 3) with these (name, size) files."""
    listed = [{"name": name, "size": size} for name, size in files]
    return {"op": "put", "first": 0, "count": 1, "attempt": 0, "step": 7, "source": 3, "files": listed}


def _put(address: str, data: bytes, crc: int, whole: int = 1) -> dict:
    """A peer's put of rank 0's step 7, by hand: ``crc`` as sent for the data."""
    record = b"{}"
    header = _put_header([("rank_0", len(data)), ("rank_0.index", 1), ("rank_0.json", len(record))])
    with connect(address, 5) as sock:
        send_json(sock, header)
        assert recv_json(sock) == {"ok": True}
        sock.sendall(data)
        send_crc(sock, crc)
        for body in (b"i", record):
            sock.sendall(body)
            send_crc(sock, zlib.crc32(body))
        send_crc(sock, whole)
        try:
            return recv_json(sock)
        except Exception as err:  # noqa: BLE001 - the server drops a torn copy's connection
            return {"dropped": str(err)}


def test_a_copy_torn_on_the_way_or_rewritten_under_its_sender_is_never_held(nodes):
    tiers, servers, _ = nodes
    data = os.urandom(1 << 16)
    assert "dropped" in _put(servers[1].address, data, zlib.crc32(data) ^ 1)  # a bit flipped on the way
    assert _put(servers[1].address, data, zlib.crc32(data), whole=0) == {
        "ok": False,
        "why": "the slots changed while they were sent",
    }
    assert servers[1].held.copies(0, 1) == []
    assert [p for p in (tiers[1] / "peers").rglob("*") if p.is_file()] == []  # nothing half-written left
    assert _put(servers[1].address, data, zlib.crc32(data)) == {"ok": True}
    assert [c.step for c in servers[1].held.copies(0, 1)] == [7]


def test_a_copy_cut_mid_transfer_leaves_nothing(nodes):
    tiers, servers, _ = nodes
    with connect(servers[1].address, 5) as sock:
        send_json(sock, _put_header([("rank_0", 1 << 20)]))
        assert recv_json(sock) == {"ok": True}
        sock.sendall(b"x" * 1000)
    until(lambda: not [p for p in (tiers[1] / "peers").rglob("*") if p.is_file()], timeout=10)
    assert servers[1].held.copies(0, 1) == []


def test_a_peer_that_does_not_answer_fails_the_send_said_once_and_a_later_one_goes(nodes, tmp_path):
    tiers, servers, _ = nodes
    said = []
    _slot(tiers[0], 0, 0, 4, b"abc" * 1000)
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))  # bound, never listening: refused
        gone = f"127.0.0.1:{dead.getsockname()[1]}"
        sender = Sender(tiers[0], node=0, rate=0, say=said.append)
        try:
            sender.assign(Duty(0, 0, 1, ((2, gone), (1, servers[1].address))))
            until(lambda: servers[1].held.copies(0, 1), timeout=10)
            _slot(tiers[0], 0, 1, 5, b"def" * 1000)
            until(lambda: [c.step for c in servers[1].held.copies(0, 1)] == [5, 4], timeout=10)
            until(lambda: sender.lag() == {2: -1, 1: 0}, timeout=10)
            until(lambda: said, timeout=10)  # once it failed twice in a row, 1 s apart
        finally:
            sender.close()
    assert len([s for s in said if "to node 2 failed" in s]) == 1, said
    assert "training goes on" in said[0] and "(node 2 holds none of it)" in said[0], said


def test_two_copies_of_a_nodes_ranks_are_kept_and_the_oldest_goes(nodes):
    tiers, servers, _ = nodes
    sender = Sender(tiers[0], node=0, rate=0, say=print)
    try:
        sender.assign(Duty(1, 0, 1, ((1, servers[1].address),)))
        for step in range(1, 6):
            _slot(tiers[0], 0, step % 2, step, bytes([step]) * 100)
            until(lambda step=step: [c.step for c in servers[1].held.copies(0, 1)][:1] == [step], timeout=10)
    finally:
        sender.close()
    assert [c.step for c in servers[1].held.copies(0, 1)] == [5, 4]


def test_a_send_slower_than_the_snapshots_still_delivers_whole_copies(nodes):
    """The slots are rewritten every 20 ms while a copy takes about 0.5 s on the wire: the sender
    reads a step whole first, so copies still arrive (they failed every time when the send read
    the slots as it went: a snapshot always overtook it)."""
    tiers, servers, _ = nodes
    stop = threading.Event()

    def snapshots():
        step = 1
        while not stop.is_set():
            _slot(tiers[0], 0, step % 2, step, bytes([step % 256]) * 5000)
            step += 1
            stop.wait(0.02)

    writer = threading.Thread(target=snapshots)
    writer.start()
    sender = Sender(tiers[0], node=0, rate=10_000, say=print)
    try:
        sender.assign(Duty(0, 0, 1, ((1, servers[1].address),)))
        until(lambda: len(servers[1].held.copies(0, 1)) == 2, timeout=30)
    finally:
        sender.close()
        stop.set()
        writer.join()
    for copy in servers[1].held.copies(0, 1):
        assert (copy.folder / "rank_0").read_bytes() == bytes([copy.step % 256]) * 5000


def test_the_pace_caps_the_bytes_a_second(nodes):
    tiers, servers, _ = nodes
    _slot(tiers[0], 0, 0, 1, os.urandom(2 << 20))
    sender = Sender(tiers[0], node=0, rate=4 << 20, say=print)  # 4 MiB/s: 2 MiB take about 0.5 s
    try:
        started = time.monotonic()
        sender.assign(Duty(0, 0, 1, ((1, servers[1].address),)))
        until(lambda: servers[1].held.copies(0, 1), timeout=10)
        took = time.monotonic() - started
    finally:
        sender.close()
    assert took >= 0.4, took


def test_a_full_dev_shm_turns_copies_off_with_one_line_and_leaves_nothing_half_written(tmp_path):
    """The holder's /dev/shm (a 64 KiB tmpfs) cannot take a 100 KB copy and leave its own ranks
    the room for theirs: it says so once, takes no more, and the sender stops sending to it with
    one line; nothing of the copy stays."""
    tier = tmp_path / "tier"
    tier.mkdir()
    _slot(tier, 0, 0, 1, os.urandom(100_000))
    said_full, said = [], []
    with tiny_tmpfs(tmp_path / "shm", "64k") as shm:
        server = CopyServer(LOOPBACK, HeldCopies(shm / "peers"), said_full.append)
        sender = Sender(tier, node=0, rate=0, say=said.append)
        try:
            sender.assign(Duty(0, 0, 1, ((1, server.address),)))
            until(lambda: said, timeout=10)
            _slot(tier, 0, 1, 2, b"small")  # a copy that would fit: copies to it are off
            until(lambda: sender.reading() is not None and sender.reading().newest == 2, timeout=10)
        finally:
            sender.close()
            server.close()
        assert len(said_full) == 1 and "KiB free in" in said_full[0], said_full
        assert "a copy of 98 KiB and this node's own snapshots (196 KiB more) need more" in said_full[0]
        off = f"node 0: node 1 has no room left in /dev/shm for copies ({said_full[0]}): copies to it are off"
        assert said == [off]
        assert [p for p in shm.rglob("*") if p.is_file()] == []
        assert sender.reading().copied == -1


def test_peers_follow_the_ring_and_skip_the_nodes_own_host():
    one_host = {n: "h" for n in range(4)}
    assert peers_of(2, (0, 1, 2, 3), one_host, 1) == (3,)
    assert peers_of(3, (0, 1, 2, 3), one_host, 2) == (0, 1)
    assert peers_of(5, (0, 1, 5), one_host, 1) == (0,)  # a standby at position 2
    assert peers_of(4, (0, 1, 2), one_host, 1) == ()  # standing by: sends nothing
    two_hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert peers_of(0, (0, 1, 2, 3), two_hosts, 1) == (2,)
    assert peers_of(2, (0, 1, 2, 3), two_hosts, 5) == (0, 1)
    assert peers_of(1, (0, 1), one_host, 0) == ()


def test_a_copy_rate_below_a_byte_or_beyond_any_number_is_refused():
    from launcher.grammar.numbers import byte_rate

    assert byte_rate("500MB") == 500_000_000 and byte_rate("2GiB") == 2 * 2**30 and byte_rate("0") == 0
    for bad in ("0.5", "0.0001KB", "9" * 320 + "TB", "fast", "-1", "1e9", ""):
        with pytest.raises(ValueError):
            byte_rate(bad)


def test_node_0_is_reached_at_its_endpoints_host_and_a_follower_at_its_route_to_it():
    """Node 0's own lookup of its name may be 127.0.1.1 (Debian's /etc/hosts): the others reach it
    as the endpoint says, so it binds every interface, except on loopback."""
    from launcher.agent.copies import copy_address

    assert copy_address("127.0.0.1:29500", leads=True) == ("127.0.0.1", "127.0.0.1")
    assert copy_address("node0.cluster:29500", leads=True) == ("", "node0.cluster")
    assert copy_address("[::1]:29500", leads=True) == ("::1", "::1")
    assert copy_address("127.0.0.1:29500", leads=False) == ("127.0.0.1", "127.0.0.1")
