# ecd: make run starts the daemon, make test runs every test; both install what they need first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install native-libs proto run test test-gpu test-faults test-fuzz test-load bench lint format clean

install: $(STAMP) native-libs

# torch first, pinned: a bare torch requirement with no torch installed would pull a CUDA build.
$(STAMP): pyproject.toml requirements-vllm.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[dev,mooncake]'
	$(PY) -m pip install --quiet --no-deps vllm==0.33.0
	$(PY) -m pip install --quiet --no-deps -r requirements-vllm.txt
	touch $@

# The Mooncake transfer engine (the mooncake extra) loads the system's RDMA library, libibverbs1.
# Idempotent: installed with apt-get when missing and make runs as root; otherwise only said (the
# tests that need the engine then skip, saying why).
native-libs:
	@if { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then :; \
	elif [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make: installing libibverbs1 for the Mooncake transfer engine" >&2; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; \
	else \
		echo "make: libibverbs1 is missing (apt-get install libibverbs1 as root):" \
			"the Mooncake tests will skip" >&2; \
	fi

proto: $(STAMP)
	$(PY) proto/generate.py

run: $(STAMP)
	$(VENV)/bin/ecd serve $(ARGS)

test: $(STAMP) native-libs
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
test-faults: $(STAMP) native-libs
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
