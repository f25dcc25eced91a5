"""Each file of the run dir (and each record between nodes) that a reader can do without, damaged
from outside as a disk or a crash would: its one reader says so naming it, never a traceback."""

import json
import math

import pytest

from launcher.core.beats import LiveProgress, NodeRow, ProgressRow, ProgressShare
from launcher.runs.directory import PROGRESS_FILE, Damaged, RunDir


def _whole_progress() -> LiveProgress:
    """progress.json of a job of two nodes, with every kind of value a supervisor writes."""
    ranks = [
        ProgressRow(0, 101, 7, 0.25, "stepping", node=0),
        ProgressRow(1, 102, None, None, "starting", node=1),
        ProgressRow(2, 103, -1, 0.0, "paused", node=1),  # a beat that gave no step
    ]
    return LiveProgress(3, 1.7e9, ranks, [NodeRow(0, "a", 42, 0.0, False), NodeRow(1, None, None, 9.5, True)])


def _written(tmp_path, data) -> RunDir:
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / PROGRESS_FILE).write_bytes(
        data if isinstance(data, bytes) else json.dumps(data).encode()
    )
    return RunDir(str(tmp_path / "run"))


def test_progress_reads_back_as_written(tmp_path):
    whole = _whole_progress()
    assert _written(tmp_path, whole.to_json()).read_progress() == whole
    one_node = LiveProgress(0, 1.7e9, [ProgressRow(0, 101, 3, 1.0, "stepping")])
    assert _written(tmp_path, one_node.to_json()).read_progress() == one_node
    assert RunDir(str(tmp_path / "none")).read_progress() is None  # not written yet: nothing to say


def _set(path: str, value):
    """A change of progress.json's JSON at ``path`` (keys and indexes, dotted)."""

    def change(data):
        *above, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = data
        for key in above:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
        return data

    return change


_DELETE = object()


@pytest.mark.parametrize(
    "damage, said",
    [
        (b"", "Expecting value"),  # empty (a crash before the first write on some storage)
        (b'{"attempt": 3, "written_at": 17', "Expecting ','"),  # truncated
        (b"\xff\xfe garbage", "Expecting value"),
        (
            _set("written_at", _DELETE),
            "written_at is missing",
        ),  # `status` exited 70 on this
        (_set("written_at", math.nan), "written_at is nan"),
        (_set("written_at", 1e308), "written_at is 1e+308"),
        (_set("written_at", "yesterday"), "written_at is 'yesterday'"),
        (_set("attempt", -1), "attempt is -1"),
        (_set("attempt", 10**40), "attempt is 1000000000"),
        (_set("ranks", {"0": {}}), "ranks is {'0': {}}"),
        (_set("ranks.0", [0, 101]), "ranks is [[0, 101], {"),
        (_set("ranks.0.pid", _DELETE), "pid is missing"),
        (_set("ranks.0.rank", "0"), "rank is '0'"),
        (_set("ranks.0.step", -2), "step is -2"),
        (_set("ranks.0.silent_for", -3.0), "silent_for is -3.0"),
        (_set("ranks.0.phase", "dancing"), "'dancing' is not a valid Phase"),
        (_set("ranks.0.extra", 1), "'extra' is no field of it"),
        (_set("nodes.1.lost", "yes"), "lost is 'yes'"),
        (_set("nodes.0.pid", True), "pid is True"),
        (_set("nodes", [[]]), "nodes is [[]]"),
    ],
)
def test_a_damaged_progress_file_is_said_naming_it(tmp_path, damage, said):
    run = _written(tmp_path, damage if isinstance(damage, bytes) else damage(_whole_progress().to_json()))
    with pytest.raises(Damaged) as caught:
        run.read_progress()
    assert str(caught.value).startswith(f"{tmp_path}/run/progress.json is damaged (")
    assert said in str(caught.value)


def test_a_list_where_progress_was_is_damaged(tmp_path):
    with pytest.raises(Damaged, match=r"progress.json is damaged \(a JSON object was expected, not list\)"):
        _written(tmp_path, [_whole_progress().to_json()]).read_progress()


def test_a_progress_share_reads_back_and_refuses_what_no_follower_writes():
    share = ProgressShare(1.7e9, [ProgressRow(2, 103, 5, 0.5, "stepping")])
    assert ProgressShare.from_json(json.loads(json.dumps(share.to_json()))) == share
    assert ProgressShare.from_json({"at": 1.7e9, "rows": []}) == ProgressShare(1.7e9, [])  # just announced
    for damaged in ([], {"at": 1.7e9}, {"at": math.inf, "rows": []}, {"at": 1.0, "rows": [{"rank": 0}]}):
        with pytest.raises((ValueError, TypeError, KeyError)):
            ProgressShare.from_json(damaged)


def test_a_row_aged_past_a_clock_ahead_of_ours_is_never_silent_for_less_than_nothing():
    """A follower's clock ahead of node 0's: its share's age is negative, its rows stay writable."""
    row = ProgressRow(0, 1, 3, 0.5, "stepping").aged(-2.0)
    assert row.silent_for == 0.0 and ProgressRow.from_json(row.to_json()) == row


def _exit_line(**changes):
    """A worker_exit line of events.jsonl as a supervisor writes it, with ``changes``."""
    from launcher.core.events import Logged, WorkerExit

    line = Logged(WorkerExit(0, 1, 4242, -9, 12.5), 12.5, 1.7e9).to_json()
    line.update(changes)
    return {name: value for name, value in line.items() if value is not _DELETE}


def test_an_event_line_reads_back_with_its_negative_ints():
    from launcher.core.events import parse_logged

    assert parse_logged(_exit_line()).event.exitcode == -9  # killed by SIGKILL: not damage


@pytest.mark.parametrize(
    "changes",
    [
        {"t_wall": 1e308},  # `status --plot` drew it as a date
        {"t_wall": -1e18},  # `status --plot` said "[Errno 75] Value too large", naming no file
        {"t_mono": math.nan},
        {"t_wall": "yesterday"},
        {"t_wall": _DELETE},
        {"attempt": "0"},
        {"attempt": 10**30},
        {"exitcode": True},
        {"t_observed": math.inf},
    ],
)
def test_an_event_line_with_values_no_supervisor_writes_is_skipped(changes):
    from launcher.core.events import parse_logged

    assert parse_logged(_exit_line(**changes)) is None


def test_a_run_carried_on_keeps_the_lines_no_reader_takes(tmp_path):
    """A resumed run rewrites events.jsonl from what it read: damaged lines (and another
    version's events) were dropped from the file; they are kept as they were, each line ended."""
    good = json.dumps(_exit_line())
    torn = good[:40]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text(
        f"{good}\ngarbage\n{json.dumps(_exit_line(t_wall=1e308))}\n{torn}"
    )
    history = RunDir(str(tmp_path / "run")).read_history()
    assert [e.event.pid for e in history.events] == [4242]
    assert history.text == (tmp_path / "run" / "events.jsonl").read_bytes() + b"\n"


@pytest.mark.parametrize(
    "text, read",
    [
        ('{"message": "ValueError: boom", "timestamp": "1700000000"}', ("ValueError: boom", 1700000000)),
        ('{"message": "ValueError: boom", "timestamp": "x"}', ("ValueError: boom", 0)),  # supervisor: exit 70
        ('{"message": "ValueError: boom", "timestamp": NaN}', ("ValueError: boom", 0)),
        ('{"message": "ValueError: boom", "timestamp": 1e308}', ("ValueError: boom", 0)),
        ('{"message": {"message": "E", "extraInfo": "x"}}', ("E", 0)),  # AttributeError: exit 70
        ('{"message": {"message": "E", "extraInfo": {"timestamp": [1]}}}', ("E", 0)),
        ('{"message": "E", "timestamp": true}', ("E", 0)),
        ('{"message": {"message": "E", "extraInfo": {"py_cal', None),  # torn as the worker died
        ("[]", None),
    ],
)
def test_a_workers_damaged_error_file_never_ends_the_supervisor(tmp_path, text, read):
    """The worker writes it as it dies (or its own code writes anything there): the supervisor
    reads what it can, the message before the time."""
    from launcher.core.failures import read_error_file

    (tmp_path / "error.json").write_text(text)
    record = read_error_file(tmp_path / "error.json")
    assert (record and (record.message, record.timestamp)) == read


def test_a_memory_slots_damaged_record_is_no_slot(tmp_path):
    """int(Infinity) raised OverflowError out of the reader, where every other damage is no slot."""
    from worker_lib.checkpoint.memory_slots import SlotFiles

    slot = SlotFiles(tmp_path, 0, 0)
    slot.data.write_bytes(b"x"), slot.index.write_bytes(b"")
    for text in (
        '{"step": Infinity, "kind": "parts", "world_size": 1, "size": 1, "index_size": 0, "metrics": {}}',
        "{",
    ):
        slot.record.write_text(text)
        assert slot.read_record() is None
    slot.record.write_text(
        '{"step": 3, "kind": "parts", "world_size": 1, "size": 1, "index_size": 0, "metrics": {}}'
    )
    assert slot.read_record().step == 3
