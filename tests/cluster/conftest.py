"""One real `mooncake_master` per test module of the cluster tier; test hosts per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_testing import Master, running_master
from hosts_testing import Hosts, running_hosts


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with running_master() as master:
        yield master


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Network namespaces on a bridge (tests/hosts_testing.py), torn down after the test;
    the test skips, saying why, where they cannot be made."""
    with running_hosts() as hosts:
        yield hosts
