# ecd: make run starts the daemon, make test runs every test; both install what they need first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install proto run test test-gpu test-faults test-fuzz test-load bench lint format clean

install: $(STAMP)

# torch first, pinned: a bare torch requirement with no torch installed would pull a CUDA build.
$(STAMP): pyproject.toml requirements-vllm.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps vllm==0.33.0
	$(PY) -m pip install --quiet --no-deps -r requirements-vllm.txt
	touch $@

proto: $(STAMP)
	$(PY) proto/generate.py

run: $(STAMP)
	$(VENV)/bin/ecd serve $(ARGS)

test: $(STAMP)
	sh deploy/ci/install-tools.sh
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/ecd bench --spawn $(BENCH_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest tests/gpu -v -s $(PYTEST_ARGS)

# make test runs a sample of these three suites (pyproject.toml deselects slow and load tests);
# their own targets run them in full. -m "slow or not slow" lifts the deselection.
# Fault injection: 50 trials of each randomized fault kind, the slow ones too (4 GiB warm
# restart); ECD_FAULT_SEED=N replays, ECD_FAULT_JSON=FILE keeps the tally and figures.
test-faults: $(STAMP)
	ECD_FAULT_TRIALS=$${ECD_FAULT_TRIALS:-50} $(PY) -m pytest tests/faults -m "slow or not slow" $(PYTEST_ARGS)

# Hostile input: the long hypothesis profile, over 10,000 cases; ECD_FUZZ_JSON=FILE keeps counts.
test-fuzz: $(STAMP)
	ECD_FUZZ_PROFILE=$${ECD_FUZZ_PROFILE:-long} $(PY) -m pytest tests/fuzz -m "slow or not slow" $(PYTEST_ARGS)

# Load: 32 client processes for 60 s (ECD_LOAD_CLIENTS, ECD_LOAD_DURATION), figures printed and
# written to ECD_LOAD_JSON=FILE if set.
test-load: $(STAMP)
	$(PY) -m pytest tests/load -m load -s $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
