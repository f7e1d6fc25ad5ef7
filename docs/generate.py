"""Rewrite the generated parts of the docs (used by `make docs` and by tests/ops/test_docs.py,
so both produce exactly the same text).

A generated part lies between `<!-- NAME: begin ... -->` and `<!-- NAME: end -->` in a doc; what
is between them is replaced by the part's source. Today one part: the settings table of
docs/operations.md, from the SETTINGS table of ec_daemon/server/config.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ec_daemon.server import config

DOCS = Path(__file__).resolve().parent

# doc file -> {part name: what the part holds}
PARTS: dict[str, dict[str, Callable[[], str]]] = {
    "operations.md": {"settings": config.reference},
}


def regenerate(text: str, parts: dict[str, Callable[[], str]]) -> str:
    """text with every generated part rewritten; a part whose markers are missing is an error."""
    for name, source in parts.items():
        pattern = re.compile(rf"(<!-- {name}: begin[^\n]*-->\n)(.*?)(<!-- {name}: end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- {name}: begin' ... '<!-- {name}: end -->' markers")
        body = source() + "\n"
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(3), text)
    return text


def expected() -> dict[Path, str]:
    """Each doc with generated parts, as it should read."""
    return {DOCS / doc: regenerate((DOCS / doc).read_text(), parts) for doc, parts in PARTS.items()}


if __name__ == "__main__":
    for path, text in expected().items():
        path.write_text(text)
        print(f"wrote {path}")
