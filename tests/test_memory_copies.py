"""Memory snapshots copied to other nodes (--memory-peers, issue 51) with real nodes on loopback:
a training node's whole tree killed with its /dev/shm, never relaunched; the standby that takes
its place restores its ranks' newest snapshot from a peer's copy before they start."""

import json
import re

import pytest
import torch
from helpers import memory_folders, until
from test_many_nodes import _status_table, _status_when
from test_standby import TRAIN, _kill_tree, _standby_job, _start

from launcher.core.events import CheckpointLoaded, CopyRestored, NodesMet

pytestmark = pytest.mark.timeout(400)

# A snapshot every step, storage every 50; DDP's buckets never rebuilt, so that the resumed run sums
# every gradient in the order the clean run does (bit-identical with 3 ranks, at any step). A step
# of 100 ms: a copy must land within about a step of its snapshot for the lost node's step to be
# every rank's (the bound is for 30 ms steps: bench_copies.py; a test runs on busy cores).
ARGS = [
    "--steps",
    "240",
    "--step-time",
    "0.1",
    "--save-every",
    "50",
    "--memory-every",
    "1",
    "--fixed-buckets",
]


def _newest_step(tier) -> int:
    steps = []
    for record in tier.glob("rank_*.json"):
        try:
            steps.append(int(json.loads(record.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            pass  # being replaced
    return max(steps, default=-1)


def _copied(progress: dict, node: int) -> dict:
    """The node's row in status's progress once it says how far its copies are, else {}."""
    row = next((n for n in progress.get("nodes") or [] if n["node"] == node), None)
    return row if row and row.get("copied") is not None else {}


def test_a_node_lost_with_its_memory_resumes_from_a_peers_copy_within_two_steps_bit_identical(
    launcher, tmp_path
):
    clean_out, out = tmp_path / "clean.pt", tmp_path / "out.pt"
    clean = launcher.start("--nproc", "3", "--run-name", "clean", TRAIN, *ARGS, "--out", str(clean_out))
    assert clean.wait(300) == 0, clean.stderr

    job = _standby_job(launcher, tmp_path, "copies", *ARGS, "--out", str(out))
    metrics = tmp_path / "node0.prom"
    node0 = _start(job, node0=("--metrics-file", str(metrics))).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    lost = first.nodes[2]  # position 2: its copies go to position 0, node 0
    # Seen from outside: each training node's copies, in status (node 0 publishes every 5 s).
    report = _status_when(tmp_path, "copies", lambda p: all(_copied(p, n) for n in first.nodes), timeout=60)
    assert all(_copied(report["progress"], n)["copy_lag"] >= 0 for n in first.nodes), report["progress"]
    assert "copied on peers" in _status_table(tmp_path, "copies")
    (tier,) = memory_folders(job.nodes[lost].proc.pid)
    until(lambda: _newest_step(tier) >= 80, timeout=120, look=0.005)
    held = _newest_step(tier)  # the kill comes at most a step later
    _kill_tree(job.nodes[lost])

    codes = {n: job.nodes[n].wait(300) for n in (0, 1, standby) if n != lost}
    assert set(codes.values()) == {0}, (codes, node0.stderr, job.nodes[standby].stderr)
    (restored,) = job.nodes[standby].events(CopyRestored)
    assert (restored.attempt, restored.ranks, restored.holder, restored.source) == (1, [2], 0, lost), restored
    assert restored.step >= held - 1, (restored, held)
    starts = {
        n: re.findall(r"rank \d attempt 1 starts at step (\d+)", job.nodes[n].stdout)
        for n in (0, first.nodes[1], standby)
    }
    assert {n: s for n, s in starts.items()} == {n: [str(restored.step)] for n in starts}, starts
    said = f"node {standby}: step {restored.step} of rank 2 from node 0's copy of node {lost}"
    assert said in job.nodes[standby].stderr
    summary = (
        f"attempt 1: node {standby} got step {restored.step} of rank 2 from node 0's copy of node {lost}"
    )
    assert summary in node0.stderr  # node 0's summary, from the standby's report
    loaded = {n: [e for e in job.nodes[n].events(CheckpointLoaded) if e.attempt == 1] for n in (0, standby)}
    assert [(e.step, e.tier) for e in loaded[standby]] == [(restored.step, "another node's copy")], loaded
    assert [(e.step, e.tier) for e in loaded[0]] == [(restored.step, "memory")], loaded
    final = metrics.read_text()
    assert re.search(r"^ftlaunch_memory_copy_step\{[^}]*\} \d+\.0$", final, re.M), final
    assert re.search(r"^ftlaunch_memory_copy_sent_bytes_total\{[^}]*\} [1-9]", final, re.M), final
    a, b = torch.load(clean_out), torch.load(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert job.survivors() == [] and clean.survivors() == []


def _starts(job, nodes) -> set:
    return {
        s for n in nodes for s in re.findall(r"rank \d attempt 1 starts at step (\d+)", job.nodes[n].stdout)
    }


def test_two_nodes_lost_at_once_with_the_copy_one_held_every_rank_loads_from_storage(launcher, tmp_path):
    """Positions 1 and 2 killed together: position 1's copy was on position 2, lost with it. The
    standby and position 2's node relaunched take the places; position 2's ranks get their copy
    from node 0, position 1's get none (said), and every rank loads the storage step."""
    clean_out, out = tmp_path / "clean.pt", tmp_path / "out.pt"
    clean = launcher.start("--nproc", "3", "--run-name", "clean", TRAIN, *ARGS, "--out", str(clean_out))
    assert clean.wait(300) == 0, clean.stderr
    job = _standby_job(launcher, tmp_path, "two", *ARGS, "--out", str(out), options=["--max-failures", "3"])
    node0 = _start(job).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    one, two = first.nodes[1], first.nodes[2]
    _status_when(tmp_path, "two", lambda p: _copied(p, one) and _copied(p, two), timeout=60)
    _kill_tree(job.nodes[one], job.nodes[two])
    job.start(two)  # relaunched on its machine; node one never comes back

    codes = {n: job.nodes[n].wait(300) for n in (0, standby, two)}
    assert set(codes.values()) == {0}, (codes, node0.stderr)
    met = node0.events(NodesMet)[-1]
    places = dict(zip(met.nodes, range(3)))
    took_one = next(n for n in (standby, two) if places[n] == 1)
    took_two = next(n for n in (standby, two) if places[n] == 2)
    assert "no other node holds a copy of rank 1's memory snapshots" in job.nodes[took_one].stderr
    (restored,) = job.nodes[took_two].events(CopyRestored)
    assert (restored.ranks, restored.holder, restored.source) == ([2], 0, two), restored
    starts = _starts(job, (0, standby, two))
    assert len(starts) == 1 and int(starts.pop()) % 50 == 0, starts  # the storage step, on every rank
    a, b = torch.load(clean_out), torch.load(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert job.survivors() == [] and clean.survivors() == []


def test_a_copy_trailing_on_a_slow_link_shows_its_lag_and_is_never_chosen_over_newer_steps(
    launcher, tmp_path
):
    """--memory-copy-rate 5KB: a copy (about 19 KB a rank here) trails by many steps, shown as its
    lag in status, while the job trains on. The standby restores that old copy; the survivors hold
    newer steps only, so no step is every rank's in memory, and every rank loads from storage."""
    clean_out, out = tmp_path / "clean.pt", tmp_path / "out.pt"
    clean = launcher.start("--nproc", "3", "--run-name", "clean", TRAIN, *ARGS, "--out", str(clean_out))
    assert clean.wait(300) == 0, clean.stderr
    job = _standby_job(
        launcher, tmp_path, "slow", *ARGS, "--out", str(out), options=["--memory-copy-rate", "5KB"]
    )
    node0 = _start(job).nodes[0]
    first = node0.wait_for_event(NodesMet, lambda e: e.attempt == 0, timeout=120)
    (standby,) = first.standby
    lost = first.nodes[2]
    seen = _status_when(tmp_path, "slow", lambda p: _copied(p, lost).get("copy_lag", 0) >= 10, timeout=90)
    lagging = _copied(seen["progress"], lost)
    _kill_tree(job.nodes[lost])

    codes = {n: job.nodes[n].wait(300) for n in (0, first.nodes[1], standby)}
    assert set(codes.values()) == {0}, (codes, node0.stderr)
    (restored,) = job.nodes[standby].events(CopyRestored)
    assert restored.step <= lagging["copied"] + lagging["copy_lag"], (restored, lagging)
    starts = _starts(job, (0, first.nodes[1], standby))
    assert len(starts) == 1 and int(starts.pop()) % 50 == 0, starts  # not the old copy's step
    a, b = torch.load(clean_out), torch.load(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert job.survivors() == [] and clean.survivors() == []
