"""Checkpoints on real storage (local disk, GCS emulator, S3 emulator), one rank in-process:
commit marker, verification and fallback, retention, RNG, async save, bad storage."""

import hashlib
import json
import logging
import os
import random
import subprocess
import threading
import time

import google_crc32c
import pytest
import torch

from worker_lib.checkpoint.manager import CheckpointError, CheckpointManager, LocalChannel
from worker_lib.checkpoint.marker import MARKER, step_dir, step_numbers
from worker_lib.checkpoint.retention import RetentionPolicy
from worker_lib.core.storage import Storage, StorageError


def _manager(url, **kwargs) -> CheckpointManager:
    return CheckpointManager(Storage(url), rank=0, world_size=1, channel=LocalChannel(), **kwargs)


def _state(value: float):
    return {"model": {"w": torch.full((4, 4), value)}, "step_in_epoch": int(value)}


def test_save_commit_and_load(storage):
    manager = _manager(storage.url)
    assert manager.load() is None  # a fresh run
    manager.save(10, _state(1.0), metrics={"loss": 0.5}, blocking=True)
    manager.save(20, _state(2.0), metrics={"loss": 0.4})
    manager.wait()

    loaded = _manager(storage.url).load()
    assert loaded.step == 20 and loaded.metrics == {"loss": 0.4}
    assert torch.equal(loaded.state["model"]["w"], torch.full((4, 4), 2.0))
    marker = json.loads(manager.storage.read_bytes(f"{step_dir(20)}/{MARKER}"))
    part = manager.storage.read_bytes(f"{step_dir(20)}/rank_0.pt")
    assert marker["parts"]["rank_0.pt"] == {"size": len(part), "crc32c": f"{google_crc32c.value(part):08x}"}


@pytest.mark.parametrize("flip", [False, True])
def test_a_step_of_an_earlier_version_listing_sha256_still_loads_and_is_still_checked(storage, flip):
    """Markers written before CRC32C list SHA-256: a run saved by them resumes, and damage to
    such a step is still found."""
    manager = _manager(storage.url)
    manager.save(10, _state(1.0), blocking=True)
    name = f"{step_dir(10)}/rank_0.pt"
    data = bytearray(manager.storage.read_bytes(name))
    marker = json.loads(manager.storage.read_bytes(f"{step_dir(10)}/{MARKER}"))
    marker["parts"]["rank_0.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manager.storage.write_bytes(f"{step_dir(10)}/{MARKER}", json.dumps(marker).encode())
    if flip:
        data[len(data) // 2] ^= 0x01
        manager.storage.write_bytes(name, bytes(data))
    loaded = _manager(storage.url).load()
    if flip:
        assert loaded is None
    else:
        assert loaded.step == 10 and torch.equal(loaded.state["model"]["w"], torch.full((4, 4), 1.0))


def test_a_step_without_its_marker_does_not_exist(storage):
    manager = _manager(storage.url)
    manager.save(10, _state(1.0), blocking=True)
    manager.save(20, _state(2.0), blocking=True)
    manager.storage.fs.rm_file(
        manager.storage.path(f"{step_dir(20)}/{MARKER}")
    )  # as if cut off before commit
    assert _manager(storage.url).load().step == 10


@pytest.mark.parametrize("marker", [b"[]", b"{}", b'{"step": 20, "parts": []}', b"\x00garbage", b"null"])
def test_a_damaged_marker_is_a_missing_one(tmp_path, marker, caplog):
    manager = _manager(str(tmp_path / "ckpt"))
    manager.save(10, _state(1.0), blocking=True)
    manager.save(20, _state(2.0), blocking=True)
    (tmp_path / "ckpt" / step_dir(20) / MARKER).write_bytes(marker)
    assert _manager(str(tmp_path / "ckpt")).load().step == 10  # step 20 does not exist for readers
    assert f"{step_dir(20)}/{MARKER} is not one ftlaunch writes: the step is skipped, and kept" in caplog.text
    assert (tmp_path / "ckpt" / step_dir(20) / MARKER).read_bytes() == marker  # never deleted for it


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_part_falls_back_to_the_previous_step(storage, damage, caplog):
    manager = _manager(storage.url)
    manager.save(10, _state(1.0), blocking=True)
    manager.save(20, _state(2.0), blocking=True)
    part = f"{step_dir(20)}/rank_0.pt"
    data = manager.storage.read_bytes(part)
    if damage == "delete":
        manager.storage.fs.rm_file(manager.storage.path(part))
    else:
        flipped = data[:50] + bytes([data[50] ^ 0xFF]) + data[51:]  # same size, one bit pattern off
        manager.storage.write_bytes(part, flipped if damage == "corrupt" else data[:100])

    loaded = _manager(storage.url).load()

    assert loaded.step == 10
    assert "checkpoint step 20 is not usable" in caplog.text
    assert {"corrupt": "fails its checksum", "truncate": "has 100 bytes", "delete": "is missing"}[
        damage
    ] in caplog.text


def test_retention_keeps_the_last_k_and_the_best(storage):
    policy = RetentionPolicy(keep_last=2, keep_best=1, metric="loss", mode="min")
    manager = _manager(storage.url, retention=policy)
    losses = {10: 0.9, 20: 0.1, 30: 0.5, 40: 0.7, 50: 0.6}
    for step, loss in losses.items():
        manager.save(step, _state(float(step)), metrics={"loss": loss})
    manager.wait()
    assert step_numbers(manager.storage) == [20, 40, 50]


def test_uncommitted_leftovers_are_cleaned_up_later(storage):
    manager = _manager(storage.url)
    manager.storage.write_bytes(f"{step_dir(5)}/rank_0.pt", b"half a save from a crashed run")
    manager.save(10, _state(1.0), blocking=True)
    manager.wait()  # retention deletes in the background, after the commit
    assert step_numbers(manager.storage) == [10]


def test_rng_states_are_restored_with_the_checkpoint(storage):
    manager = _manager(storage.url)
    random.seed(7)
    torch.manual_seed(7)
    manager.save(1, _state(0.0), blocking=True)
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)

    _manager(storage.url).load()

    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_async_save_returns_before_the_write_and_copies_the_state(storage):
    manager = _manager(storage.url)
    state = {"w": torch.zeros(1000)}
    release = threading.Event()
    write = manager.storage.write_stream

    def slow_write(rel, fill, retries=True):
        release.wait(30)  # the write cannot finish until the training loop has moved on
        return write(rel, fill, retries)

    manager.storage.write_stream = slow_write
    manager.save(1, state)
    state["w"] += 5  # training goes on and changes the tensor in place
    release.set()
    manager.wait()
    assert torch.equal(_manager(storage.url).load().state["w"], torch.zeros(1000))


def test_async_saves_reuse_their_copy_once_it_is_written(tmp_path):
    manager = _manager(str(tmp_path / "ckpt"), retention=RetentionPolicy(keep_last=3))
    state = {"w": torch.zeros(1000), "steps": [torch.ones(3)]}
    manager.save(1, state)
    manager.wait()
    first_copy = manager._staging["w"].data_ptr()
    state["w"] += 7
    manager.save(2, state)  # copies into the first save's buffers: no new allocation
    assert manager._staging["w"].data_ptr() == first_copy
    state["w"] += 1  # and the copy is still independent of the training state
    manager.wait()

    def saved(step):
        return torch.load(tmp_path / "ckpt" / f"step_{step}" / "rank_0.pt", weights_only=False)["state"]["w"]

    assert torch.equal(saved(2), torch.full((1000,), 7.0))
    assert torch.equal(saved(1), torch.zeros(1000))  # step 1 was written before its copy was reused


def test_a_background_failure_is_raised_at_the_next_call(storage):
    manager = _manager(storage.url)

    def broken(rel, fill, retries=True):
        raise StorageError("disk full")

    manager.storage.write_stream = broken
    manager.save(1, _state(1.0))
    with pytest.raises(Exception, match="the previous checkpoint save failed: disk full"):
        manager.save(2, _state(2.0))


def test_writable_storage_passes_the_probe(storage):
    Storage(storage.url).check_writable("test")


def test_bad_storage_is_a_clear_error_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StorageError, match="is not usable"):
        Storage(str(blocker / "ckpt")).check_writable("r0")
    with pytest.raises(StorageError, match="nosuchproto"):
        Storage("nosuchproto://bucket/x")


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_missing_bucket_is_a_clear_error(kind, request, monkeypatch):
    from conftest import use_emulator

    use_emulator(kind, request.getfixturevalue(f"{kind}_env"), monkeypatch)
    with pytest.raises(StorageError, match="is not usable"):
        Storage(f"{kind}://no-such-bucket-here/run").check_writable("r0")


def test_unreachable_endpoint_is_a_clear_error(monkeypatch):
    # Nothing listens on port 9 (discard) of the loopback: the connection is refused at once.
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    storage = Storage("s3://bucket/run", endpoint_url="http://127.0.0.1:9", key="k", secret="s")
    with pytest.raises(StorageError, match="is not usable: writing .*Could not connect to the endpoint"):
        storage.check_writable("r0")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), so a save really runs out of space."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI and dev machines run as root)")
def test_a_full_disk_fails_the_save_and_keeps_the_previous_step(tiny_disk, caplog):
    manager = _manager(str(tiny_disk / "ckpt"))
    manager.save(1, {"w": torch.zeros(25_000)}, blocking=True)  # 100 kB: fits
    manager.save(2, {"w": torch.ones(500_000)})  # 2 MB: cannot fit
    with pytest.raises(Exception, match="No space left on device"):
        manager.wait()
    assert "retry" in caplog.text
    assert not [p for p in (tiny_disk / "ckpt").rglob("*.tmp-*")]  # the torn file was removed
    with pytest.raises(CheckpointError, match="rank 0 saves no more checkpoints: an earlier save failed"):
        manager.save(3, {"w": torch.zeros(10)})  # would fit, but could never commit with its peers'
    assert not (tiny_disk / "ckpt" / step_dir(3)).exists()
    loaded = _manager(str(tiny_disk / "ckpt")).load()
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(25_000))


def test_a_storage_outage_during_a_save_is_retried(tmp_path, monkeypatch, caplog):
    """The GCS emulator goes down after step 1 and comes back while step 2 is being saved."""
    import fsspec
    from storage_servers import start_gcs

    server, env = start_gcs(tmp_path, keep_data=True)
    port = int(env["FSSPEC_GCS_ENDPOINT_URL"].rsplit(":", 1)[1])
    monkeypatch.setitem(
        fsspec.config.conf, "gcs", {"token": "anon", "endpoint_url": env["FSSPEC_GCS_ENDPOINT_URL"]}
    )
    try:
        fsspec.filesystem("gcs").mkdir("outage")
        manager = _manager("gcs://outage/run")
        manager.save(1, _state(1.0), blocking=True)
        manager.wait()  # retention's deletions too: they must not meet the outage
        server.stop()
        caplog.set_level(logging.DEBUG, logger="gcsfs")
        manager.save(2, _state(2.0))  # in the background, against a storage that is down
        deadline = time.monotonic() + 60  # evidence: a write failed on the dead storage and is retried
        while not any("retrying after exception" in r.getMessage() for r in list(caplog.records)):
            assert time.monotonic() < deadline, "the save never met the outage"
            time.sleep(0.05)
        server, _ = start_gcs(tmp_path, port=port, keep_data=True)
        manager.wait()  # no error: the write was retried once the storage was back
        loaded = _manager("gcs://outage/run").load()
        assert loaded.step == 2 and torch.equal(loaded.state["model"]["w"], torch.full((4, 4), 2.0))
    finally:
        server.stop()


class _Planted:
    """A pickle that runs a command when loaded: what someone who can write the storage could plant."""

    def __init__(self, witness: str) -> None:
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


def _plant(manager, step: int, payload) -> None:
    """Replace the step's part with ``payload`` and re-sign the marker, as an attacker with write
    access to the storage would: checksums cannot help against that. (Signed with SHA-256, as
    markers of earlier versions are.)"""
    import io

    buffer = io.BytesIO()
    torch.save({"rng": None, "state": payload}, buffer)
    data = buffer.getvalue()
    manager.storage.write_bytes(f"{step_dir(step)}/rank_0.pt", data)
    marker = json.loads(manager.storage.read_bytes(f"{step_dir(step)}/{MARKER}"))
    marker["parts"]["rank_0.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manager.storage.write_bytes(f"{step_dir(step)}/{MARKER}", json.dumps(marker).encode())


def test_a_planted_pickle_is_refused_not_run(tmp_path):
    manager = _manager(str(tmp_path / "ckpt"))
    manager.save(1, _state(1.0), blocking=True)
    witness = tmp_path / "code_ran"
    _plant(manager, 1, _Planted(str(witness)))

    with pytest.raises(
        CheckpointError, match="rank_0.pt holds objects the weights-only loader refuses .*posix.system"
    ):
        _manager(str(tmp_path / "ckpt")).load()
    assert not witness.exists()  # nothing of it ran
    _manager(str(tmp_path / "ckpt"), trusted=True).load()  # the documented way out runs it: trust is explicit
    assert witness.exists()


def test_training_state_loads_with_the_weights_only_loader(tmp_path):
    """Model and optimizer state dicts, numbers, strings, and every RNG (numpy's included) need no trust."""
    import numpy

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3, "note": "x"}
    numpy.random.seed(7)
    manager = _manager(str(tmp_path / "ckpt"))
    manager.save(1, state, blocking=True)
    expected = numpy.random.rand(3)
    numpy.random.seed(99)

    loaded = _manager(str(tmp_path / "ckpt")).load()
    assert loaded.state["optimizer"]["param_groups"][0]["lr"] == 0.1 and loaded.state["epoch"] == 3
    assert torch.equal(loaded.state["model"]["weight"], model.state_dict()["weight"])
    assert numpy.array_equal(numpy.random.rand(3), expected)  # numpy's stream continues


@pytest.mark.parametrize("make", ["another_users", "writable_by_all", "a_link", "old_0755"])
def test_the_node_cache_is_private_and_this_users_own(tmp_path, monkeypatch, make):
    import tempfile

    from worker_lib.checkpoint.directory import node_cache_root

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = tmp_path / f"ftlaunch-cache-{os.getuid()}"
    if make == "a_link":
        (tmp_path / "elsewhere").mkdir()
        base.symlink_to(tmp_path / "elsewhere")
    else:
        base.mkdir(mode=0o700)
        os.chmod(base, {"another_users": 0o700, "writable_by_all": 0o777, "old_0755": 0o755}[make])
        if make == "another_users":
            if os.geteuid() != 0:
                pytest.skip("giving a folder to another user needs root (CI and dev machines run as root)")
            os.chown(base, 12345, 12345)
    if make == "old_0755":  # left by an earlier version: ours and not writable by others
        assert node_cache_root("run") == base / "run" and base.stat().st_mode & 0o777 == 0o700
    else:
        with pytest.raises(CheckpointError, match=f"refusing the node cache {base}"):
            node_cache_root("run")


def test_a_loaded_state_does_not_depend_on_its_file(tmp_path):
    """A local part is mapped for the load; its objects are copied out, so what the file becomes
    afterwards (overwritten in place, deleted by retention or another node) cannot reach the
    state. Tensors that shared storage when saved still share it."""
    manager = _manager(str(tmp_path / "ckpt"))
    tied = torch.arange(1024, dtype=torch.float32)
    manager.save(1, {"a": tied, "b": tied, "c": torch.ones(7)}, blocking=True)
    loaded = _manager(str(tmp_path / "ckpt")).load().state
    part = tmp_path / "ckpt" / step_dir(1) / "rank_0.pt"
    with open(part, "r+b") as handle:  # the same inode: a shared mapping of it would see this
        handle.write(b"\0" * part.stat().st_size)
    assert torch.equal(loaded["a"], torch.arange(1024, dtype=torch.float32))
    assert torch.equal(loaded["c"], torch.ones(7))
    assert loaded["a"].data_ptr() == loaded["b"].data_ptr()


def test_big_writes_checksummed_beside_the_write_match_the_file_in_a_forked_child_too(tmp_path):
    """Writes of 1 MiB and more are checksummed on a helper thread while they are written. A
    child forked after the parent's first such write has no helper thread: it must make its own,
    not wait for the parent's forever."""
    from worker_lib.core import checksum

    storage = Storage(str(tmp_path))
    pieces = [os.urandom(3 * 2**20), b"small", os.urandom(2**20), os.urandom(100)]

    def fill(handle):
        for piece in pieces:
            handle.write(piece)

    assert storage.write_stream("parent.bin", fill) == checksum.of_file(str(tmp_path / "parent.bin"))
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its own big write checksums right
        try:
            found = storage.write_stream("child.bin", fill)
            os._exit(0 if found == checksum.of_file(str(tmp_path / "child.bin")) else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's checksummed write never finished")
    assert os.waitstatus_to_exitcode(status) == 0
