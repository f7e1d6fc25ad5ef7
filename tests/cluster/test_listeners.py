"""Where the store's processes listen and what they tell others: every listener binds the address
it was given, or, where Mooncake cannot be made to, the daemon says so at start
(docs/operations.md, Joining a Mooncake Store)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

from cluster_testing import Master, store_daemon
from ecd_testing import Daemon, wait_until

from ec_daemon.cluster.listening import Listener, listeners

UNCONFINED = "the store's transfer engine listens on every address of this host"


def unconfined_warning(daemon: Daemon) -> dict[str, Any]:
    """The daemon's line at its join naming the transfer engine's listeners it could not bind
    to --transfer-host (its log is JSON)."""
    wait_until(lambda: "joined the store" in daemon.log(), 20)
    records = [json.loads(line) for line in daemon.log().splitlines()]
    [warning] = [r for r in records if r["msg"].startswith(UNCONFINED)]
    assert warning["level"] == "warning"
    return warning


def metadata(master: Master, key: str) -> Any:
    url = f"{master.metadata}?key={urllib.parse.quote(key, safe='')}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def test_the_master_binds_each_listener_to_its_address_but_the_metadata_server(
    master: Master,
) -> None:
    assert master.proc is not None
    assert listeners(master.proc.pid) == {
        Listener("127.0.0.1", master.rpc_port),
        Listener("127.0.0.1", master.admin_port),
        # Mooncake 0.3's own metadata server ignores --http_metadata_server_host.
        Listener("0.0.0.0", master.http_port),
    }


def test_a_store_daemon_names_at_start_each_listener_not_bound_to_its_transfer_host(
    master: Master,
) -> None:
    with store_daemon(master, "--log-format", "json") as daemon:
        warning = unconfined_warning(daemon)
        assert daemon.proc is not None
        opened = listeners(daemon.proc.pid)
    assert warning["transfer_host"] == "127.0.0.1"
    elsewhere = {x.port for x in opened if x.host != "127.0.0.1"}
    assert elsewhere, opened  # Mooncake 0.3 binds them to every address: the line says so
    assert sorted(elsewhere) == warning["ports"], (opened, warning)


def test_a_store_daemon_tells_the_others_its_transfer_host_as_its_address(
    master: Master,
) -> None:
    with store_daemon(master, "--log-format", "json") as daemon:
        segment = unconfined_warning(daemon)["segment"]
        handshake = metadata(master, f"mooncake/rpc_meta/{segment}")
        descriptor = metadata(master, f"mooncake/ram/{segment}")
    assert handshake["ip_or_host_name"] == "127.0.0.1", handshake
    assert descriptor["tcp_data_host"] == "127.0.0.1", descriptor
