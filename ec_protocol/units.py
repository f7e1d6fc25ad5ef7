"""Byte sizes written the way operators write them: 8GiB, 512MiB, 1.5G, 4096."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in `text`; ValueError naming the accepted forms if it is not a size."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; expected e.g. 4096, 512MiB, 8GiB or 1.5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, i = float(nbytes), 0
    while abs(value) >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{nbytes} B" if i == 0 else f"{value:.1f} {units[i]}"
