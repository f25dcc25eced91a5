"""scripts/ettr.py (issue 50 item 9), imported: its arithmetic on traces small enough to work out by
hand, ftlaunch against torchrun on the default inputs, every input's source, bad input."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import ettr  # noqa: E402

# A crash goes back to a save every 30 s and is down 10 s; a node loss to one every 300 s, 100 s.
TINY = ettr.Plan(
    "tiny", (ettr.Kind("crash", 1, down_s=10, save_every_s=30), ettr.Kind("node", 0, 100, 300)), blocked=0.0
)


def _report(capsys, *argv: str) -> dict:
    assert ettr.main(["--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_crash_redoes_the_training_since_its_save_and_is_down_its_time():
    # 100 s trained, back to the save at 90, down 10 s to 110, then 890 s more: 980 of 1,000 kept
    assert ettr.replay(TINY, [(100.0, "crash")], 1000.0) == pytest.approx(0.98)
    # on average half an interval is redone: 1 - (10 + 15) / 1000
    assert ettr.expected(TINY, 1000.0) == pytest.approx(0.975)


def test_an_interruption_during_a_recovery_starts_when_it_is_over_and_goes_back_to_its_own_tier():
    # the crash leaves 90 s kept and recovers until 110; the node loss, at 105, then goes back to
    # storage's save at 0 and is down until 210: 790 s kept
    assert ettr.replay(TINY, [(100.0, "crash"), (105.0, "node")], 1000.0) == pytest.approx(0.79)
    # a recovery past the window's end keeps nothing after it
    assert ettr.replay(TINY, [(950.0, "node")], 1000.0) == pytest.approx(0.9)


def test_the_time_saves_block_the_loop_is_not_training():
    blocked = ettr.Plan("tiny", TINY.kinds, blocked=0.1)
    assert ettr.replay(blocked, [(100.0, "crash")], 1000.0) == pytest.approx(0.98 * 0.9)
    assert ettr.expected(blocked, 1000.0) == pytest.approx(0.975 * 0.9)


def test_the_trace_is_the_seeds_and_a_kind_that_never_happens_never_comes():
    counts = {"node": 300.0, "crash": 0.0, "hang": 40.0, "planned": 0.0}
    first = ettr.trace(counts, 1e6, seed=7)
    assert first == ettr.trace(counts, 1e6, seed=7) != ettr.trace(counts, 1e6, seed=8)
    assert {name for _, name in first} == {"node", "hang"}
    assert [t for t, _ in first] == sorted(t for t, _ in first) and 0 < first[0][0] <= first[-1][0] < 1e6
    assert 340 - 4 * 340**0.5 < len(first) < 340 + 4 * 340**0.5  # Poisson: within 4 standard deviations


def test_ftlaunch_keeps_more_training_than_torchrun_on_the_default_inputs(capsys):
    r = _report(capsys)
    (ft_mean, ft_replay), (tr_mean, tr_replay) = r["ettr"]["ftlaunch"], r["ettr"]["torchrun"]
    assert ft_mean >= tr_mean and ft_replay >= tr_replay, r["ettr"]
    for kind, (down, redone) in r["costs"]["ftlaunch"].items():
        assert down + redone <= sum(r["costs"]["torchrun"][kind]), kind
    assert sum(r["counts"].values()) == 419 + 47  # Table 5's unexpected and the planned ones


def test_each_kind_costs_what_its_launcher_does_with_it(capsys):
    costs = _report(capsys)["costs"]
    ft, tr = costs["ftlaunch"], costs["torchrun"]
    # [down, redone on average]: storage every 100 steps of 6 s, memory every step
    assert ft["node"] == pytest.approx([5.35 + 0.18 + 0.28, 300])  # a standby's place, from storage
    assert ft["crash"] == pytest.approx([0.61 + 0.28, 3])  # in place, from memory
    assert ft["hang"] == pytest.approx([120 + 0.57 + 0.61 + 0.28, 3])  # heartbeats, then as a crash
    assert ft["planned"] == pytest.approx([4.92 + 0.28, 0])  # stopped at a save, started again
    assert tr["node"] == pytest.approx([1800 + 12.7 + 9.77, 300])  # a relaunch, then a cold start
    assert tr["crash"] == pytest.approx([11.78 + 9.77, 300])
    assert tr["hang"] == pytest.approx([600 + 11.78 + 9.77, 300])  # NCCL's timeout, then as a crash
    assert tr["planned"] == pytest.approx([12.7 + 9.77, 0])


def test_gpu_faults_restarted_in_place_move_from_node_losses_to_crashes(capsys):
    r = _report(capsys, "--gpu-in-place", "0.25")
    assert r["counts"]["node"] == 268 * 0.75 + 53 and r["counts"]["crash"] == 56 + 268 * 0.25


def test_every_input_says_where_its_figure_comes_from():
    page = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    headings = [line.lstrip("#").strip() for line in page if re.match(r"#{2,3} ", line)]
    options = {spec.name.replace("_", "-") for spec in ettr.INPUTS}
    for spec in ettr.INPUTS:
        sections = re.findall(r'"([^"]+)"', spec.source) if "benchmarks.md" in spec.source else []
        for section in sections:
            assert any(h.startswith(section) for h in headings), (spec.name, section)
        alias = re.match(r"as --([a-z-]+):", spec.source)
        assert (
            sections
            or (alias and alias.group(1) in options)
            or re.match(r"(assumption: |bound \(item 3\), not yet measured|Llama 3 paper)", spec.source)
            or "(a setting)" in spec.source
        ), spec
    replace = next(spec for spec in ettr.INPUTS if spec.name == "replace_s")
    assert replace.source.startswith('benchmarks.md "A node lost: standby replacement"')
    assert replace.default == 5.35  # measured (0.49 - 0.14) + --node-timeout 5 s


def test_the_table_in_the_docs_is_what_the_script_prints_today():
    printed = ettr.text(ettr.report(ettr.parse([])))
    assert printed in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--host-faults", "-1"], "--host-faults must be a finite number >= 0, got -1"),
        (["--gpu-in-place", "1.5"], "--gpu-in-place is a fraction between 0 and 1, got 1.5"),
        (["--days", "nan"], "--days must be a finite number >= 0, got nan"),
        (["--step-s", "0"], "--step-s must be above 0, got 0"),
        (["--relaunch-s", "half an hour"], "argument --relaunch-s: invalid float value: 'half an hour'"),
        (["--restarts", "3"], "unrecognized arguments: --restarts 3"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, said):
    assert ettr.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"ettr.py: error: {said}\n"
