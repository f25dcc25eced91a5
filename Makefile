# `make demo` and `make test` work on a fresh machine: `install` builds .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINTED := launcher worker_lib tests scripts examples

.PHONY: install system test test-unit demo bench chaos lint integration clean

install: system $(STAMP)

# The system's part: Debian's prometheus server, which a test has scrape a real run. As root only
# (CI is); elsewhere, or when apt cannot install it, that test says why it is skipped.
system:
	@if [ "$$(id -u)" = 0 ] && ! command -v prometheus >/dev/null 2>&1; then \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; }; } || \
		echo "make: prometheus could not be installed; the test against a real Prometheus will be skipped"; \
	fi

# torch is pinned first: that version's CPU wheel is on this machine's disk; an unpinned
# torch would download a multi-GB CUDA build. Users get `torch>=2.4` from setup.cfg.
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,examples,plot,lightning,transformers,accelerate]'
	touch $(STAMP)

# Most tests wait (for deadlines, steps, other nodes) rather than compute: twice as many test
# workers as cores keeps both busy. --dist loadgroup keeps the SLURM cluster's tests on one worker.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 2 )))

# Where PYTHONDONTWRITEBYTECODE is set (as on these machines) nothing caches ftlaunch's own
# bytecode, and every supervisor, zygote and guard of every launch would compile it again (0.1 s
# of CPU for the supervisor's imports alone, measured); compiled once here (only what changed).
test: install
	$(PY) -m compileall -q launcher worker_lib > /dev/null
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The inner loop: tests that start no process (tests/unit), in seconds.
test-unit: install
	$(PY) -m pytest -p no:xdist tests/unit

demo: install
	rm -rf demo_run
	$(VENV)/bin/ftlaunch --nproc 2 --run-dir demo_run --preload sklearn.datasets \
		examples/train.py --epochs 15 --crash-at-step 170

bench: install
	$(PY) scripts/bench_recovery.py
	$(PY) scripts/bench_recovery_nodes.py
	$(PY) scripts/bench_standby.py
	$(PY) scripts/bench_scale.py
	$(PY) scripts/bench_fork_server.py
	$(PY) scripts/bench_zygote.py
	$(PY) scripts/bench_goodput.py
	$(PY) scripts/bench_load_cache.py
	$(PY) scripts/bench_checkpoint.py
	$(PY) scripts/bench_heartbeat.py
	$(PY) scripts/bench_metrics.py

# The reliability matrix: every fault, 10 times, against examples/train.py, and on 2 and 3 nodes
# against a plain DDP script (docs/reliability.md).
chaos: install
	$(PY) scripts/chaos_matrix.py --trials 10
	$(PY) scripts/chaos_nodes.py --trials 10

lint: install
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy  # launcher/ and worker_lib/, as setup.cfg's [mypy] says

# Exactly what CI runs.
integration:
	bash .ci/run

clean:
	rm -rf $(VENV) demo_run bench_runs ftlaunch_logs ftlaunch_runs .pytest_cache *.egg-info
