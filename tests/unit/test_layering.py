"""The packages' arrows of imports (docs/design.md §2). The daemon uses the client library's
public modules and the generated protobuf modules, never a private one; the client library never
imports the daemon. Inside each package, layers import one way only: a module imports its own
layer and the layers below it, never one above."""

from __future__ import annotations

import ast
from pathlib import Path

import ec_client

REPO = Path(__file__).resolve().parents[2]

# Layers top to bottom. A module's layer is that of the longest of these names its own name starts
# with: the daemon's loose modules (`cli`, `__main__`) are its top.
DAEMON_LAYERS = [
    ("ec_daemon",),
    ("ec_daemon.tools",),
    ("ec_daemon.server",),
    ("ec_daemon.cluster",),
    ("ec_daemon.core",),
]
# The client library's loose modules (the API's values, its errors, ...) and the pool file's
# format and locks are its base, which the daemon shares; the public names (`ec_client`) sit on
# top, beside the vLLM connector and the benches.
CLIENT_LAYERS = [
    ("ec_client", "ec_client.vllm", "ec_bench"),
    ("ec_client.data",),
    ("ec_client.control",),
    (
        "ec_protocol.pool",
        "ec_protocol.types",
        "ec_protocol.errors",
        "ec_protocol.units",
        "ec_protocol.address",
        "ec_protocol.token_file",
        "ec_protocol._proto",
    ),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: str) -> dict[str, set[str]]:
    """Each module of the package (the generated protobuf modules aside) and every name it
    imports, by its full name, wherever in the module the import is."""
    found: dict[str, set[str]] = {}
    for path in (REPO / package).rglob("*.py"):
        if "_proto" in path.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from P import X` takes P.X: a module of P, or a name P holds.
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                raise AssertionError(f"{path}: a relative import hides its layer")
        found[module_name(path)] = names
    return found


def imported(package: str) -> set[str]:
    return set().union(*modules(package).values())


def layer(name: str, layers: list[tuple[str, ...]]) -> int:
    """The rank of the layer a module (or a name it holds) belongs to, 0 at the top: that of the
    longest prefix it starts with."""
    return max(
        (len(prefix), rank)
        for rank, prefixes in enumerate(layers)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    )[1]


def upward_imports(package: str, layers: list[tuple[str, ...]]) -> list[str]:
    return [
        f"{module} imports {name}, a layer above its own"
        for module, names in sorted(modules(package).items())
        for name in sorted(names)
        if name.split(".")[0] == package and layer(name, layers) < layer(module, layers)
    ]


def test_the_daemon_imports_no_private_module_of_the_client_library() -> None:
    private = {
        name
        for name in imported("ec_daemon")
        if name.startswith("ec_client.")
        and any(part.startswith("_") for part in name.split(".")[1:])
        and not name.startswith("ec_protocol._proto.")
        and name != "ec_client.__version__"
    }
    assert not private


def test_the_client_library_never_imports_the_daemon() -> None:
    assert not {name for name in imported("ec_client") if name.split(".")[0] == "ec_daemon"}


def test_each_daemon_layer_imports_only_itself_and_the_layers_below() -> None:
    """cli -> tools -> server -> cluster -> core."""
    assert not upward_imports("ec_daemon", DAEMON_LAYERS)


def test_the_daemon_core_imports_no_grpc_protobuf_or_asyncio() -> None:
    """The core is synchronous pure Python: the server translates and waits, the core decides."""
    banned = ("grpc", "google.protobuf", "ec_protocol._proto", "asyncio", "uvloop")
    core = layer("ec_daemon.core", DAEMON_LAYERS)
    found = {
        f"{module} imports {name}"
        for module, names in modules("ec_daemon").items()
        if layer(module, DAEMON_LAYERS) == core
        for name in names
        if any(name == root or name.startswith(root + ".") for root in banned)
    }
    assert not found


def test_each_client_layer_imports_only_itself_and_the_layers_below() -> None:
    """vllm, benches, the public names -> data path -> control client -> base."""
    assert not upward_imports("ec_client", CLIENT_LAYERS)


def test_dir_of_the_client_library_lists_its_public_names_and_not_its_imports() -> None:
    """Those loaded on first use (Producer, Consumer, ...) too, for completion in a shell."""
    public = {name for name in dir(ec_client) if not name.startswith("_")}
    assert public == set(ec_client.__all__)
    assert "__version__" in dir(ec_client)


def test_the_client_library_imports_torch_only_in_its_data_path_and_above() -> None:
    """The daemon and the control clients never pay for importing torch (the public names load
    the data path on first use)."""
    found = {
        f"{module} imports {name}"
        for module, names in modules("ec_client").items()
        if layer(module, CLIENT_LAYERS) >= layer("ec_client.control", CLIENT_LAYERS)
        or module == "ec_client"
        for name in names
        if name.split(".")[0] == "torch"
    }
    assert not found


def fields_written_through(package: str) -> list[str]:
    """Each assignment in the package's modules to a field of an object that one of its own
    objects holds (`self._node.lookup_failures += 1`, `self._store.pool.index.counters.x = 0`)."""
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for written in ast.walk(target):
                    held = written.value if isinstance(written, ast.Attribute) else None
                    if (
                        isinstance(held, ast.Attribute)
                        and isinstance(held.value, ast.Name)
                        and held.value.id == "self"
                    ):
                        found.append(f"{module_name(path)}:{node.lineno} {ast.unparse(target)}")
    return found


def test_the_server_and_the_cluster_write_no_field_of_an_object_they_hold() -> None:
    """A counter or a state is written by the object that owns it, through a method it gives:
    the service does not count the cluster's misses in its place, the cluster does not move the
    node's or the core's counters (docs/design.md §2)."""
    assert not fields_written_through("ec_daemon/server")
    assert not fields_written_through("ec_daemon/cluster")
