"""The packages' one arrow of imports (docs/design.md §2): the daemon uses the client library's
public modules and the generated protobuf modules, never a private one; the client library never
imports the daemon."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported(package: str) -> set[str]:
    """Every module the package's files import, by its full name."""
    names: set[str] = set()
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_daemon_imports_no_private_module_of_the_client_library() -> None:
    private = {
        name
        for name in imported("ec_daemon")
        if name.startswith("ec_client.")
        and any(part.startswith("_") for part in name.split(".")[1:])
        and not name.startswith("ec_client._proto.")
        and name != "ec_client.__version__"
    }
    assert not private


def test_the_client_library_never_imports_the_daemon() -> None:
    assert not {name for name in imported("ec_client") if name.split(".")[0] == "ec_daemon"}
