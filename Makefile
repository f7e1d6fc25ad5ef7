# ecd: make run starts the daemon, make test runs every test; both install what they need first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install proto run test test-gpu bench lint format clean

install: $(STAMP)

# torch first, pinned: a bare torch requirement with no torch installed would pull a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[dev]'
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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
