"""The level each line of the native layer (the Mooncake Store client, C++, logging with glog on
stderr) takes in the daemon's log. glog's own level is the library's view: it logs at error what
is normal for ecd (a lookup of its own descriptor before it first writes it, at every join) and
repeats a master's absence a few times a second. The lines ecd expects are listed here, with the
level they deserve (docs/operations.md, Logs); any other line keeps glog's level, and a line that
is not glog's (no level prefix) is a warning."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

# glog's line prefix (`E1201 19:56:52.081182 21746 file.cpp:1098] ...`): its level letter.
_GLOG = re.compile(r"([IWEF])\d{4} ")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


@dataclass(frozen=True)
class Expected:
    """Lines the daemon expects (`pattern` found in the line): logged at `level`; with
    `every_s`, at most once in that many seconds at it (those in between at debug)."""

    what: str
    pattern: re.Pattern[str]
    level: int
    every_s: float = 0.0


# The daemon's own line about a master that does not answer (logger `ecd.cluster`) comes every
# 10 s; the store client's are its detail: the first at warning, then one a minute.
MASTER_AWAY_EVERY_S = 60.0

EXPECTED = (
    Expected(
        "at every join: the client asks the metadata server for its own entries before it "
        "first writes them",
        re.compile(r"GET \S+ http=404 body: metadata not found"),
        logging.DEBUG,
    ),
    Expected(
        "at every join, after the lookup above",
        re.compile(r"Failed to retrieve segment descriptor"),
        logging.DEBUG,
    ),
    Expected(
        "glog's own notice, once at the client's first line",
        re.compile(r"^WARNING: Logging before InitGoogleLogging\(\)"),
        logging.DEBUG,
    ),
    Expected(
        "the master does not answer (stopped, restarting, unreachable): the client's calls "
        "and pings fail and it reconnects",
        re.compile(
            r"\] (Client not available|(Batch )?RPC call failed|Failed to ping master"
            r"|Reconnect failed)"
        ),
        logging.WARNING,
        MASTER_AWAY_EVERY_S,
    ),
)


class NativeLevels:
    """The level of each native line as it comes (keeps when each repeated kind was last
    logged at its level)."""

    def __init__(self, expected: tuple[Expected, ...] = EXPECTED) -> None:
        self._expected = expected
        self._logged_at: dict[str, float] = {}

    def level(self, line: str, now: float) -> int:
        for kind in self._expected:
            if kind.pattern.search(line):
                if not kind.every_s:
                    return kind.level
                last = self._logged_at.get(kind.what)
                if last is not None and now - last < kind.every_s:
                    return logging.DEBUG
                self._logged_at[kind.what] = now
                return kind.level
        glog = _GLOG.match(line)
        return _GLOG_LEVELS[glog.group(1)] if glog else logging.WARNING
