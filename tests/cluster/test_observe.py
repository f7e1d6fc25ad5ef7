"""Whether a daemon is in its Mooncake Store, as operators see it: `ecd stats`, the metrics and
the health service `ecd.cluster` (docs/operations.md, Joining a Mooncake Store)."""

from __future__ import annotations

import torch
from cluster_testing import Master, scrape, store_daemon
from ecd_testing import run_ecd, wait_until

from ec_client import Producer, check_health
from ec_daemon.tools.spawn import free_port


def test_stats_metrics_and_health_say_whether_the_store_is_connected() -> None:
    master = Master()  # its ports chosen, nothing listening there yet
    port = free_port()
    try:
        with store_daemon(master, "--metrics-port", str(port)) as daemon:
            stats = run_ecd("stats", "--address", daemon.address).stdout
            assert f"store {master.address} NOT CONNECTED" in stats, stats
            assert scrape(port)["ecd_cluster_connected"] == 0
            assert check_health(daemon.address) == "SERVING"  # it serves locally all the same
            assert check_health(daemon.address, service="ecd.cluster") == "NOT_SERVING"
            master.start()
            wait_until(lambda: check_health(daemon.address, service="ecd.cluster") == "SERVING", 30)
            with daemon.client() as client:
                client.open_pool("seen", 4096, 1 << 20, cluster_namespace="ns")
                Producer(client, "seen").put("k", torch.ones(4, 2048, dtype=torch.bfloat16))
                wait_until(lambda: scrape(port)["ecd_cluster_published_total"] == 1, 20)
            assert scrape(port)["ecd_cluster_connected"] == 1
            stats = run_ecd("stats", "--address", daemon.address).stdout
            assert f"store {master.address} connected; published 1," in stats, stats
    finally:
        master.stop()
