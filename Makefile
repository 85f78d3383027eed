# Common commands. `make demo` and `make test` install everything they need first.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export HF_HUB_OFFLINE ?= 1
export VLLM_NO_USAGE_STATS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-unit test-integration test-long demo demo-calc demo-long demo-longtail bench lint format

setup:
	bash scripts/setup.sh

# Which tests run where (docs/development.md): tests/unit (no server of any kind; `make test-unit`),
# tests/integration (real vLLM-CPU, Redis, gloo, network namespaces) and benchmarks/tests (the
# benchmarks' own tests). `make test` runs all of them except those marked `long`, in two phases: first
# every test that tolerates sharing the cores, two files at a time (pytest-xdist; a file stays on one
# worker, so its module's servers start once); then, alone, the files that time fault detection against a
# running workload, bound a latency or an elapsed time tightly, or shape links in network namespaces
# (SERIAL_FILES in tests/conftest.py). Both phases always run; either failing (or collecting nothing)
# fails the target.
TESTS := tests/unit tests/integration benchmarks/tests
test: setup
	$(PY) -m pytest -q --timeout=900 --durations=50 -n 2 --dist loadfile --no-loadscope-reorder -m "not long and not serial" \
		$(TESTS); parallel=$$?; \
	$(PY) -m pytest -q --timeout=900 --durations=20 -m "serial and not long" $(TESTS); serial=$$?; \
	echo "make test: parallel phase exit $$parallel, serial phase exit $$serial"; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]

# The contributor's loop: every server-free test (tests/unit and the benchmarks' own unit tests). Work
# stealing: a worker that runs out takes tests queued on the other, so the few long ones do not end it alone.
test-unit: setup
	$(PY) -m pytest -q --timeout=120 -n 2 --dist worksteal tests/unit benchmarks/tests -m "not slow and not long"

# One integration file, or all of them one file at a time: make test-integration FILE=tests/integration/test_actor.py
FILE ?= tests/integration
test-integration: setup
	$(PY) -m pytest -q --timeout=900 -m "not long" $(FILE)

# Single-fault recovery runs (server killed, server stopped, trainer killed), which the chaos test in
# `make test` also covers; minutes each.
test-long: setup
	$(PY) -m pytest -q --timeout=900 -m long $(TESTS)

demo: setup
	$(PY) -m pipeline_rl.cli demo

# The multi-turn recipe: multiplication with a calculator tool (docs/tasks.md, "calc").
demo-calc: setup
	$(PY) -m pipeline_rl.cli demo --recipe calc

# The long-answer recipe: remainders by written repeated subtraction, 15-290 tokens per answer (docs/tasks.md, "remainder").
demo-long: setup
	$(PY) -m pipeline_rl.cli demo --recipe remainder

# Reasoning RL's length shape: most answers one line, a fifth 20-30 lines (docs/tasks.md, "longtail").
demo-longtail: setup
	$(PY) -m pipeline_rl.cli demo --recipe longtail

# Every benchmark, in order, sharing servers (hours); one: .venv/bin/python -m benchmarks NAME (docs/benchmarks.md).
bench: setup
	$(PY) -m benchmarks all

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix . && $(PY) -m ruff format .
