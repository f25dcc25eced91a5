#!/usr/bin/env bash
# Every GPU check and benchmark, on a GPU machine, in one run (DEVELOPERS.md): the machine, then
# tests/gpu, then the benchmarks one after another (never beside the tests: they time things).
# Each step has its own time limit, so one that hangs leaves the others their time; each one's
# output goes to $OUT/<step>.txt and its last lines to the console.
#
#     bash scripts/gpu_check.sh [STEP ...]      # default: every step; e.g. `bench_gpu` alone
#
# On CPU (a dry run: tests/gpu is skipped, the benchmarks run on the CPU) set GPU_CHECK_DEVICE=cpu.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" >/dev/null && [ "$DEVICE" = cuda ]; then
    # gcsfs and google-crc32c; in .whl/adapters the frameworks, pytest-xdist and pytest-timeout;
    # numpy only where the machine has none (DEVELOPERS.md)
    wheels=(.whl/*.whl .whl/adapters/*.whl)
    $PY -c "import numpy" 2>/dev/null || wheels+=(.whl/numpy/*.whl)
    $PY -m pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}" 2>&1 | tail -n 2
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - started)) s (limit $limit s)"
    tail -n "${TAIL:-30}" "$OUT/$name.txt"
}

machine() {
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
      $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'gpus', torch.cuda.device_count())"
      for lib in lightning transformers accelerate numpy; do
          $PY -c "import $lib; print('$lib', $lib.__version__)" 2>&1 | tail -n 1
      done
    } >"$OUT/machine.txt" 2>&1
    cat "$OUT/machine.txt"
}

run() {
    case $1 in
    machine) machine ;;
    # The tests start real ftlaunch runs of one rank each: four at a time share the one GPU.
    tests) step tests 240 $PY -m pytest -q -rfE -p no:cacheprovider -n 4 --timeout 220 --durations 20 tests/gpu ;;
    bench_gpu) step bench_gpu 130 $PY scripts/bench_gpu.py --sizes "${SIZES:-400M,1.6G}" --device "$DEVICE" ;;
    bench_gpu_restart)
        # shellcheck disable=SC2086  # the sizes are words
        step bench_gpu_restart 150 $PY scripts/bench_gpu_restart.py --device "$DEVICE" --sizes ${RESTART_SIZES:-400 1600} ;;
    probe) step probe 60 $PY scripts/probe_cuda_imports.py ;;
    probe_exit) step probe_exit 60 $PY scripts/probe_gpu_exit.py ;;
    *) echo "unknown step $1 (machine, tests, bench_gpu, bench_gpu_restart, probe, probe_exit)"; return 2 ;;
    esac
}

for name in "${@:-machine tests bench_gpu bench_gpu_restart probe}"; do
    for one in $name; do run "$one"; done
done
