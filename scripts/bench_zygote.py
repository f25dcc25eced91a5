"""What the fork server's zygote costs in CPU, and what a worker's exit costs, side by side with
the torchrun worker (a new interpreter with the same imports).

    python scripts/bench_zygote.py [--repeats 7]

Rows, each the median (min-max) of ``--repeats`` fresh processes, CPU seconds from wait4:
- the zygote's imports (``zygote.BASE_PRELOAD``), with the collector on as Python starts, and
  off as the zygote imports now (then ``gc.freeze()``);
- a worker's exit once its script is done: a child forked from such a frozen zygote leaving by
  the interpreter's teardown (``sys.exit``) or by ``worker_exit.leave``; and a new interpreter
  with the same imports (a torchrun worker) leaving by its teardown. A worker's exit is paid by each rank
  at the end of a run, and by a rank that exits on an error.
"""

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter: import what the zygote imports, collector on or off.
_IMPORTS = textwrap.dedent(
    """
    import gc, sys
    from launcher.forked.zygote import BASE_PRELOAD, preload
    if sys.argv[1] == "off":
        gc.disable()
    preload(list(BASE_PRELOAD))
    gc.freeze()
    """
)
# Run in a fresh interpreter: the zygote's imports, then N children forked, each leaving one way;
# prints each child's CPU (wait4), in seconds.
_FORKED_EXIT = textwrap.dedent(
    """
    import gc, os, sys
    from launcher.forked.worker_exit import leave, remember_imported
    from launcher.forked.zygote import BASE_PRELOAD, preload
    gc.disable()
    preload(list(BASE_PRELOAD))
    remember_imported()
    gc.freeze()
    for _ in range(int(sys.argv[2])):
        pid = os.fork()
        if pid == 0:
            gc.enable()
            if sys.argv[1] == "teardown":
                sys.exit(0)
            leave(None)
        _, _, usage = os.wait4(pid, 0)
        print(usage.ru_utime + usage.ru_stime, flush=True)
    """
)
# Run in a fresh interpreter (a torchrun worker): the same imports, then its CPU so far; the
# parent's wait4 minus that is its exit.
_NEW_INTERPRETER = textwrap.dedent(
    """
    import resource, sys
    from launcher.forked.zygote import BASE_PRELOAD, preload
    preload(list(BASE_PRELOAD))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(usage.ru_utime + usage.ru_stime, flush=True)
    """
)


def _env() -> Dict[str, str]:
    # As in the zygote: one thread for OpenMP and OpenBLAS.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _output_and_cpu(code: str, *args: str) -> tuple:
    """What a new interpreter running ``code`` printed, and its CPU seconds (wait4)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=_env(), cwd=ROOT, stdout=subprocess.PIPE)
    out = proc.stdout.read().decode()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0, f"exit status {status}"
    return out, usage.ru_utime + usage.ru_stime


def _cell(values: List[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    imports: Dict[str, List[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        for collector in imports:
            imports[collector].append(_output_and_cpu(_IMPORTS, collector)[1])

    exits: Dict[str, List[float]] = {}
    for way in ("teardown", "leave"):
        out, _ = _output_and_cpu(_FORKED_EXIT, way, str(args.repeats))
        exits[way] = [float(line) for line in out.split()]
    exits["new interpreter"] = []
    for _ in range(args.repeats):
        out, total = _output_and_cpu(_NEW_INTERPRETER)
        exits["new interpreter"].append(total - float(out))

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, {args.repeats} runs each")
    print()
    print("| the zygote's imports (BASE_PRELOAD) | CPU s, median (min–max) |")
    print("|---|---|")
    print(f"| collector on (as Python starts) | {_cell(imports['on'])} |")
    print(f"| collector off, then gc.freeze() (ftlaunch now) | {_cell(imports['off'])} |")
    print()
    print("| a worker's exit after its script | CPU ms, median (min–max) |")
    print("|---|---|")
    print(f"| forked from the zygote, interpreter teardown (before) | {_cell(exits['teardown'], 1000, 0)} |")
    print(f"| forked from the zygote, worker_exit.leave (ftlaunch now) | {_cell(exits['leave'], 1000, 0)} |")
    fresh = _cell(exits["new interpreter"], 1000, 0)
    print(f"| torchrun: a new interpreter, same imports, teardown | {fresh} |")


if __name__ == "__main__":
    main()
