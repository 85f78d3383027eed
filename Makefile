# Common commands. `make demo` and `make test` install everything they need first.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export HF_HUB_OFFLINE ?= 1
export VLLM_NO_USAGE_STATS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-unit test-integration test-long test-fast demo demo-calc demo-long bench lint format

setup:
	bash scripts/setup.sh

# Both suites: tests/unit (no servers, seconds) and tests/integration (real vLLM-CPU, Redis, gloo), in
# two phases. First every test that tolerates sharing the cores, two files at a time (pytest-xdist; a
# file stays on one worker, so its module's servers start once); then, alone, the files that time fault
# detection against a running workload, bound a latency or an elapsed time tightly, or shape links in
# network namespaces (SERIAL_FILES in tests/integration/conftest.py). Both phases always run; either
# failing (or collecting nothing) fails the target.
test: setup
	$(PY) -m pytest -q --timeout=900 --durations=50 -n 2 --dist loadfile -m "not long and not serial" \
		tests/unit tests/integration; parallel=$$?; \
	$(PY) -m pytest -q --timeout=900 --durations=20 -m "serial and not long" tests/integration; serial=$$?; \
	echo "make test: parallel phase exit $$parallel, serial phase exit $$serial"; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]

test-unit: setup
	$(PY) -m pytest -q --timeout=120 tests/unit

test-integration: setup
	$(PY) -m pytest -q --timeout=900 -m "not long" tests/integration  # one file at a time

# Single-fault recovery runs (server killed, server stopped, trainer killed), which the chaos test in
# `make test` also covers; minutes each.
test-long: setup
	$(PY) -m pytest -q --timeout=900 -m long tests/integration

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

demo: setup
	$(PY) -m pipeline_rl.cli demo

# The multi-turn recipe: multiplication with a calculator tool (docs/tasks.md, "calc").
demo-calc: setup
	$(PY) -m pipeline_rl.cli demo --recipe calc

# The long-answer recipe: remainders by written repeated subtraction, 15-290 tokens per answer (docs/tasks.md, "remainder").
demo-long: setup
	$(PY) -m pipeline_rl.cli demo --recipe remainder

bench: setup
	$(PY) -m pipeline_rl.cli bench all

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix . && $(PY) -m ruff format .
