"""Which master leads the store (docs/design.md §13): with several masters (`mooncake_master
--enable_ha`), the leader is whoever holds the master view in etcd, a key written under an etcd
lease (5 s in Mooncake 0.3.x) that a standby takes once the leader's lease runs out. The store
client follows it by itself (`--store-master etcd://HOST:PORT[;HOST:PORT...]` is its
master_server_addr); the node reads the same key to name the leader, to count its changes, and
to probe the leader's port while the store does not answer.

The key is `mooncake-store/{cluster id}/master_view`, its value the leader's HOST:PORT; the
cluster id is the masters' --cluster_id, which clients read from MC_STORE_CLUSTER_ID (default
mooncake_cluster), as the store client does. It is read through etcd's JSON gateway
(`/v3/kv/range`, etcd 3.4 and later): no etcd client library for one key.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.request
from dataclasses import dataclass

ETCD = "etcd://"
DEFAULT_CLUSTER_ID = "mooncake_cluster"  # Mooncake's, without MC_STORE_CLUSTER_ID
READ_TIMEOUT_S = 1.0


class NoLeader(Exception):
    """No master leads the store now (or etcd does not answer); the message says why."""


@dataclass(frozen=True)
class View:
    """The store's master view: the leader, and the etcd revision that created its key (a new
    one each time a master takes the lead)."""

    leader: str  # HOST:PORT
    version: int


def etcd_endpoints(master: str) -> list[str]:
    """The etcd endpoints of an `etcd://HOST:PORT[;HOST:PORT...]` master address; [] for the
    HOST:PORT of a single master."""
    if not master.startswith(ETCD):
        return []
    return master[len(ETCD) :].split(";")


def view_key() -> str:
    cluster_id = os.environ.get("MC_STORE_CLUSTER_ID") or DEFAULT_CLUSTER_ID
    return f"mooncake-store/{cluster_id.rstrip('/')}/master_view"


def read_view(endpoints: list[str], timeout_s: float = READ_TIMEOUT_S) -> View:
    """The master view, from the first endpoint that answers; NoLeader if none answers or none
    holds a view (no master leads: the last one's lease ran out, the next is not elected)."""
    key = base64.b64encode(view_key().encode()).decode()
    body = json.dumps({"key": key}).encode()
    problems = []
    for endpoint in endpoints:
        request = urllib.request.Request(f"http://{endpoint}/v3/kv/range", body)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                found = json.load(reply).get("kvs", [])
        except (OSError, ValueError) as exc:  # urllib's errors are OSErrors
            problems.append(f"{endpoint}: {exc}")
            continue
        if not found:
            raise NoLeader(f"no master leads the store: etcd at {endpoint} has no {view_key()}")
        return View(base64.b64decode(found[0]["value"]).decode(), int(found[0]["create_revision"]))
    raise NoLeader(f"etcd does not answer ({'; '.join(problems)})")
