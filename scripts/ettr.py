"""Effective training time (ETTR) of one large job under ftlaunch and under torchrun (issue 50
item 9): Llama 3 405B's interruptions replayed through the costs docs/benchmarks.md measured.

    python scripts/ettr.py [--seed N] [--json] [--OPTION VALUE ...]   (--help lists the inputs)

ETTR = time on training steps that are kept / wall time. An interruption costs its downtime and
the training since the newest save of the tier it resumes from: the expected value (half a save
interval redone) and a seeded replay (Poisson arrivals of each kind). No torch, nothing started.
"""

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# name, default, unit, then where the default comes from (indented lines continue it); a section
# of docs/benchmarks.md is named in double quotes as its heading begins.
_INPUTS = """
days                   54      days      Llama 3 paper (arXiv 2407.21783), section 3.3.4, 16,384 H100s
gpu_faults             268     count     Llama 3 paper, Table 5: faulty GPU 148, HBM3 72, SRAM 19, GPU
                                         system processor 17, silent data corruption 6, thermal 6
host_faults            53      count     Llama 3 paper, Table 5: host maintenance (unplanned) 32, NIC 7,
                                         SSD 3, power supply 3, chassis 2, IO board 2, CPU 2, memory 2
software_faults        56      count     Llama 3 paper, Table 5: software bug 54, dependency 2
network_faults         42      count     Llama 3 paper, Table 5: switch/cable 35, NCCL watchdog 7 (as hangs)
planned                47      count     Llama 3 paper, section 3.3.4: planned (automated maintenance)
gpu_in_place           0       fraction  assumption: the share of GPU faults a restart in place recovers
step_s                 6       s         assumption: 16M tokens x 6 x 405e9 FLOPs at ~400 TFLOP/s a GPU
storage_every          100     steps     assumption: a storage save every 10 minutes, both launchers
memory_every           1       steps     ftlaunch's memory tier every step (a setting)
restart_s              0.61    s         benchmarks.md "Recovery and store traffic from 2 to 32 nodes":
                                         a crash to every node's new workers, 16 loopback nodes
gpu_start_s            0.28    s         benchmarks.md "Warm spares" / "On a GPU": 400 MB, a warm spare's
                                         ready 0.04 + loaded 0.04 + first step 0.20 (H100)
replace_s              5.35    s         benchmarks.md "A node lost: standby replacement": 0.49 to full
                                         size, less 0.14 to see the loss, plus --node-timeout 5 s (a
                                         machine gone closes no connection: its silence is waited out)
storage_load_s         0.18    s         benchmarks.md "GPU staging": a load from storage, 400 MB (H200)
hang_timeout_s         120     s         ftlaunch's --heartbeat-floor, auto's least deadline (a setting)
hang_after_s           0.57    s         benchmarks.md "Heartbeats and hang detection": to a new group
cold_start_s           4.92    s         benchmarks.md "Cold start and recovery": 4 workers (CPU)
save_block_s           0.0014  s         benchmarks.md "GPU staging": a storage save, the loop blocked
snapshot_block_s       0.0006  s         benchmarks.md "GPU staging": a memory snapshot, the loop blocked
torchrun_restart_s     11.78   s         as --restart-s: torchrun in the same runs
torchrun_gpu_start_s   9.77    s         as --gpu-start-s: torchrun (5.15 + 4.40 + 0.22)
torchrun_cold_start_s  12.7    s         as --cold-start-s: torchrun
torchrun_hang_s        600     s         NCCL's default timeout (a setting): torchrun sees no hang
relaunch_s             1800    s         assumption: a person or the scheduler relaunches a lost node
torchrun_save_block_s  0.65    s         benchmarks.md "GPU staging": torch.save of the state (400 MB)
"""
ANCHORS = (
    ("Meta, Llama 3 405B: 16,384 H100s, 54 days", "> 90%", "Llama 3 paper, section 3.3.4"),
    ("ByteRobust: 9,600 GPUs, 3 months", "97%", "ByteRobust paper (arXiv 2509.16293)"),
)
KINDS = {"node": "a node lost, a GPU gone bad", "crash": "a crash", "hang": "a hang", "planned": "planned"}


@dataclass(frozen=True)
class Input:
    """One option: its default, and where that figure comes from."""

    name: str
    default: float
    unit: str  # days, count, fraction, steps, s
    source: str


def _inputs(table: str) -> Tuple[Input, ...]:
    rows: List[List[str]] = []
    for line in table.strip().splitlines():
        if line.startswith(" "):
            rows[-1][3] += " " + line.strip()
        else:
            rows.append(line.split(None, 3))
    return tuple(Input(name, float(default), unit, source) for name, default, unit, source in rows)


INPUTS = _inputs(_INPUTS)


@dataclass(frozen=True)
class Kind:
    """One kind of interruption as a launcher meets it."""

    name: str
    count: float  # in the window
    down_s: float  # no training: detection, recovery, start-up
    save_every_s: float  # training between the saves it resumes from; 0: nothing redone


@dataclass(frozen=True)
class Plan:
    """A launcher's costs: its kinds, and the share of training time its saves block the loop."""

    launcher: str
    kinds: Tuple[Kind, ...]
    blocked: float


class BadInput(Exception):
    """An input no job could have: said in one line, exit 2."""


def counts(a: argparse.Namespace) -> Dict[str, float]:
    """Table 5's rows by what a launcher meets: a GPU or host fault takes its node out."""
    lost, stayed = a.gpu_faults * (1 - a.gpu_in_place) + a.host_faults, a.gpu_faults * a.gpu_in_place
    return {"node": lost, "crash": a.software_faults + stayed, "hang": a.network_faults, "planned": a.planned}


def _kinds(a: argparse.Namespace, **costs: Tuple[float, float]) -> Tuple[Kind, ...]:
    n = counts(a)
    return tuple(Kind(k, n[k], *costs[k]) for k in KINDS)


def ftlaunch(a: argparse.Namespace) -> Plan:
    """A standby takes a lost node's place, from storage (its memory tier went with it); the rest
    restart in place from the memory tier; heartbeats find a hang."""
    start, storage, memory = a.gpu_start_s, a.step_s * a.storage_every, a.step_s * a.memory_every
    kinds = _kinds(
        a,
        node=(a.replace_s + a.storage_load_s + start, storage),
        crash=(a.restart_s + start, memory),
        hang=(a.hang_timeout_s + a.hang_after_s + a.restart_s + start, memory),
        planned=(a.cold_start_s + start, 0.0),
    )
    return Plan("ftlaunch", kinds, a.save_block_s / storage + a.snapshot_block_s / memory)


def torchrun(a: argparse.Namespace) -> Plan:
    """Every worker restarts and reloads from storage; a lost node waits for a relaunch, a hang
    for NCCL's timeout."""
    start, storage = a.torchrun_gpu_start_s, a.step_s * a.storage_every
    kinds = _kinds(
        a,
        node=(a.relaunch_s + a.torchrun_cold_start_s + start, storage),
        crash=(a.torchrun_restart_s + start, storage),
        hang=(a.torchrun_hang_s + a.torchrun_restart_s + start, storage),
        planned=(a.torchrun_cold_start_s + start, 0.0),
    )
    return Plan("torchrun", kinds, a.torchrun_save_block_s / storage)


def expected(plan: Plan, window_s: float) -> float:
    """ETTR on average: each interruption's downtime, and half a save interval redone."""
    lost = sum(k.count * (k.down_s + k.save_every_s / 2) for k in plan.kinds)
    return max(0.0, 1.0 - lost / window_s) * (1.0 - plan.blocked)


def trace(n: Dict[str, float], window_s: float, seed: int) -> List[Tuple[float, str]]:
    """Poisson arrivals of each kind over the window, in time order: the same seed, the same trace."""
    rng, events = random.Random(seed), []
    for name in KINDS:
        rate = n[name] / window_s
        t = rng.expovariate(rate) if rate > 0 else window_s
        while t < window_s:
            events.append((t, name))
            t += rng.expovariate(rate)
    return sorted(events)


def replay(plan: Plan, events: Sequence[Tuple[float, str]], window_s: float) -> float:
    """ETTR of one trace: training runs between recoveries and goes back to its tier's newest save."""
    kinds = {k.name: k for k in plan.kinds}
    resumed = kept = 0.0  # when training last resumed; seconds of training kept so far
    for t, name in events:
        start, every = max(t, resumed), kinds[name].save_every_s  # one during a recovery waits for it
        kept += start - resumed
        if every:  # back to the newest save; a hair of slack for sums that should land on one
            kept = every * math.floor(kept / every + 1e-9)
        resumed = start + kinds[name].down_s
    return (kept + max(0.0, window_s - resumed)) / window_s * (1.0 - plan.blocked)


def check(a: argparse.Namespace) -> argparse.Namespace:
    """Every input as a job could have it, before anything is computed."""
    for spec in INPUTS:
        value, flag = getattr(a, spec.name), "--" + spec.name.replace("_", "-")
        if not math.isfinite(value) or value < 0:
            raise BadInput(f"{flag} must be a finite number >= 0, got {value:g}")
        if spec.unit == "fraction" and value > 1:
            raise BadInput(f"{flag} is a fraction between 0 and 1, got {value:g}")
        if value == 0 and spec.name in ("days", "step_s", "storage_every", "memory_every"):
            raise BadInput(f"{flag} must be above 0, got 0")
    return a


def report(a: argparse.Namespace) -> dict:
    """What the tables say, as data: the inputs, each kind's count and costs, the ETTRs."""
    window_s, plans = a.days * 86400.0, (ftlaunch(a), torchrun(a))
    events = trace(counts(a), window_s, a.seed)
    return {
        "inputs": {s.name: {"value": getattr(a, s.name), "unit": s.unit, "source": s.source} for s in INPUTS},
        "counts": counts(a),
        "costs": {p.launcher: {k.name: [k.down_s, k.save_every_s / 2] for k in p.kinds} for p in plans},
        "ettr": {p.launcher: [expected(p, window_s), replay(p, events, window_s)] for p in plans},
        "replay": {"seed": a.seed, "interruptions": len(events)},
        "anchors": [{"job": job, "ettr": ettr, "source": source} for job, ettr, source in ANCHORS],
    }


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def text(r: dict) -> str:
    """The report as the markdown tables docs/benchmarks.md holds."""
    flag = {n: "--" + n.replace("_", "-") for n in r["inputs"]}
    inputs = [[flag[n], f"{i['value']:g}", i["unit"], i["source"]] for n, i in r["inputs"].items()]
    cost = {p: {k: f"{v[0]:.2f} + {v[1]:.1f}" for k, v in c.items()} for p, c in r["costs"].items()}
    costs = [[what, f"{r['counts'][k]:g}", *(cost[p][k] for p in cost)] for k, what in KINDS.items()]
    ettrs = [[p, f"{mean:.1%}", f"{one:.1%}", "this script"] for p, (mean, one) in r["ettr"].items()]
    ettrs += [[f"{job} (reported)", ettr, "", source] for job, ettr, source in ANCHORS]
    days, seed, n = r["inputs"]["days"]["value"], r["replay"]["seed"], r["replay"]["interruptions"]
    head = ["interruption", f"count in {days:g} days", *(f"{p}: down + redone on average (s)" for p in cost)]
    replayed = f"ETTR, replay (seed {seed}: {n} interruptions)"
    jobs = ["job (16,384 GPUs: 2,048 nodes of 8)", "ETTR, expected", replayed, "source"]
    tables = (_table(["input", "value", "unit", "source"], inputs), _table(head, costs), _table(jobs, ettrs))
    return "\n\n".join(tables)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(message)  # one line, where argparse would print its usage too


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = _Parser(prog="ettr.py", description=(__doc__ or "").split("\n\n")[0])
    for spec in INPUTS:
        flag, says = "--" + spec.name.replace("_", "-"), f"{spec.source} [default: {spec.default:g}]"
        parser.add_argument(flag, type=float, default=spec.default, metavar=spec.unit.upper(), help=says)
    parser.add_argument("--seed", type=int, default=0, help="the replay's trace [default: 0]")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = check(parse(argv))
    except BadInput as e:
        print(f"ettr.py: error: {e}", file=sys.stderr)
        return 2
    r = report(args)
    print(json.dumps(r, indent=1) if args.json else text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
