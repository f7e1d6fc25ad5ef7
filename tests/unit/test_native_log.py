"""The level each line of the Mooncake Store client's glog output takes in the daemon's log
(ec_daemon.server.native_log): the lines of every join are debug, a master's absence is a warning
at most once a minute, anything else keeps glog's level. The lines are as the 0.3.13 client wrote
them here, at a join and while its master was killed and started again."""

from __future__ import annotations

import logging

import pytest

from ec_daemon.server.native_log import MASTER_AWAY_EVERY_S, NativeLevels

JOIN = [
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "E1206 23:58:08.384706  7351 transfer_metadata_plugin.cpp:292] GET http://127.0.0.1:18582"
    "/metadata?key=mooncake%2Fram%2F127.0.0.1%3A14153 http=404 body: metadata not found",
    "W1206 23:58:08.384724  7351 transfer_metadata.cpp:1115] Failed to retrieve segment "
    "descriptor, name 127.0.0.1:14153",
    # Joining again, once a restarted master answers (its metadata server starts empty).
    "E1206 23:59:58.056490 12379 transfer_metadata_plugin.cpp:292] GET http://127.0.0.1:18582"
    "/metadata?key=mooncake%2Frpc_meta%2F127.0.0.1%3A12443 http=404 body: metadata not found",
]
MASTER_AWAY = [
    "E1206 23:59:30.013065 10712 master_client.cpp:370] RPC call failed: End of file",
    "E1207 05:05:53.588502  9985 master_client.cpp:416] Batch RPC call failed: End of file",
    "E1206 23:59:30.034538 10732 client_service.cpp:4857] Failed to ping master",
    "E1206 23:59:35.237852 10710 master_client.cpp:361] Client not available",
    "E1206 23:59:37.373741 10710 master_client.cpp:406] Client not available",
    "E1206 23:59:40.805989 10732 client_service.cpp:4897] Failed to ping master for 3 times "
    "(non-HA); reconnecting to 127.0.0.1:51552",
    "E1206 23:59:45.307484 10732 client_service.cpp:4902] Reconnect failed to "
    "127.0.0.1:51552: RPC_FAIL",
]


@pytest.mark.parametrize("line", JOIN)
def test_a_line_of_every_join_is_debug(line: str) -> None:
    assert NativeLevels().level(line, now=0.0) == logging.DEBUG


@pytest.mark.parametrize("line", MASTER_AWAY)
def test_a_master_away_is_a_warning_the_first_time(line: str) -> None:
    assert NativeLevels().level(line, now=0.0) == logging.WARNING


def test_a_master_away_is_a_warning_at_most_once_a_minute_and_debug_in_between() -> None:
    levels = NativeLevels()
    seen = [levels.level(line, now=i * 2.0) for i, line in enumerate(MASTER_AWAY * 2)]
    assert seen == [logging.WARNING] + [logging.DEBUG] * (len(seen) - 1)
    assert levels.level(MASTER_AWAY[2], now=MASTER_AWAY_EVERY_S) == logging.WARNING
    assert levels.level(MASTER_AWAY[2], now=MASTER_AWAY_EVERY_S + 1) == logging.DEBUG


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("I1206 23:57:46.670461  6431 master.cpp:1374] Starting", logging.INFO),
        ("W1206 23:58:08.384724  7351 client.cpp:10] Something else", logging.WARNING),
        ("E1206 23:57:46.670727  6431 client.cpp:121] Failed to mount segment", logging.ERROR),
        ("F1206 23:57:46.670817  6431 client.cpp:1608] Check failed", logging.CRITICAL),
    ],
)
def test_any_other_glog_line_keeps_glog_level(line: str, level: int) -> None:
    assert NativeLevels().level(line, now=0.0) == level


def test_a_line_that_is_not_glog_is_a_warning() -> None:
    assert NativeLevels().level("*** Check failure stack trace: ***", now=0.0) == logging.WARNING
