"""Structured logs: `key=value` text (default) or one JSON object per line (--log-format json).

Handlers pass context as `extra={...}`; every extra field becomes a key of the line. Info level
carries one line per session open/close, pool create/adopt/drop, eviction burst and error; never
one line per item.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import TextIO

from ec_daemon.server.native_log import NativeLevels

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    fields: dict[str, object] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
    if record.exc_info:
        fields["exc"] = logging.Formatter().formatException(record.exc_info)
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in _fields(record).items():
            text = str(value)
            if not text or any(c in text for c in ' "=\n'):
                text = json.dumps(text)
            parts.append(f"{key}={text}")
        return " ".join(parts)


def capture_native_stderr() -> TextIO:
    """Turn what is written to file descriptor 2 (the Mooncake engine logs there, with glog,
    bypassing Python) into records of logger `native`, one per line, so that a JSON log is
    JSON on every line, each at the level `native_log` gives it. Returns a stream to the real
    stderr, for the handler itself: its lines must not come back through the pipe."""
    real = os.fdopen(os.dup(2), "w", buffering=1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    threading.Thread(
        target=_forward_native, args=(read_end,), name="ecd-native-stderr", daemon=True
    ).start()
    return real


def _forward_native(read_end: int) -> None:
    log = logging.getLogger("native")
    levels = NativeLevels()
    with os.fdopen(read_end, errors="replace") as lines:
        for line in lines:
            text = line.rstrip("\n")
            log.log(levels.level(text, time.monotonic()), text)


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(capture_native_stderr() if log_format == "json" else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
