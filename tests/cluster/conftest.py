"""One real `mooncake_master` per test module of the cluster tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_testing import Master, running_master


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with running_master() as master:
        yield master
