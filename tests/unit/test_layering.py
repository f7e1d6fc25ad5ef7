"""The packages' arrows of imports (docs/design.md §2). The base (`ec_protocol`: the protocol,
the API's values, the pool file's format) imports neither side; the daemon and the client library
stand on it, and the client library never imports the daemon. The daemon uses the client library
only in the `ecd` command and its tools (the control commands, the bench), never a private module
of it; the benchmarks (`ec_bench`) sit above both. Inside each package, layers import one way
only: a module imports its own layer and the layers below it, never one above."""

from __future__ import annotations

import ast
import subprocess
import sys
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
# The public names (`ec_client`) sit on top, beside the vLLM connector; the base they stand on is
# ec_protocol, outside the package.
CLIENT_LAYERS = [
    ("ec_client", "ec_client.vllm"),
    ("ec_client.data",),
    ("ec_client.control",),
]
# The pool file's format and locks stand on the loose modules (the API's values, the dtypes, the
# errors, ...).
PROTOCOL_LAYERS = [
    ("ec_protocol.pool",),
    ("ec_protocol",),
]
# Modules that only keep an old import path working, naming what moved above them.
OLD_PATHS = {"ec_client.vllm.bench": "ec_bench.vllm"}


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


def names_of(package: str, roots: tuple[str, ...]) -> set[str]:
    """Each `module imports name` of the package whose name lies under one of the roots."""
    return {
        f"{module} imports {name}"
        for module, names in modules(package).items()
        for name in names
        if name.split(".")[0] in roots
    }


def test_the_base_imports_neither_the_daemon_nor_the_client_library() -> None:
    assert not names_of("ec_protocol", ("ec_daemon", "ec_client", "ec_bench"))


def test_each_base_layer_imports_only_itself_and_the_layers_below() -> None:
    """The pool's format and locks -> the API's values, the dtypes, errors, units, ..."""
    assert not upward_imports("ec_protocol", PROTOCOL_LAYERS)


def test_the_daemon_imports_the_client_library_only_in_the_ecd_command_and_its_tools() -> None:
    """`cli.py` (the control commands: health, stats, ls, ...) and `tools/` (the bench's spawned
    daemons): the server, the cluster tier and the core stand on the base alone."""
    server = layer("ec_daemon.server", DAEMON_LAYERS)
    assert not {
        found
        for found in names_of("ec_daemon", ("ec_client",))
        if layer(found.split()[0], DAEMON_LAYERS) >= server
    }


def test_nothing_imports_the_benchmarks_but_ecd_bench_and_an_old_path() -> None:
    found = names_of("ec_daemon", ("ec_bench",)) | names_of("ec_client", ("ec_bench",))
    assert {line.split()[0] for line in found} == {"ec_daemon.cli", *OLD_PATHS}
    for old, new in OLD_PATHS.items():
        assert {name.rpartition(".")[0] for name in modules("ec_client")[old]} == {new}


def test_ecd_serve_loads_no_client_module_and_no_torch() -> None:
    """What the imports above keep, at run time: `ecd serve`'s modules (the command, the server,
    the core) leave the client library and torch unloaded (nothing imports them along the way,
    not even a package's __init__); the control commands import the client when they run."""
    probe = (
        "import sys, ec_daemon.cli, ec_daemon.server.server, ec_daemon.core.store\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ec_client', 'torch')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert loaded == "[]\n"


def test_the_base_and_the_daemon_never_import_torch() -> None:
    """The daemon installs without torch (pyproject's `torch` extra is the tensor side's)."""
    assert not names_of("ec_protocol", ("torch",)) | names_of("ec_daemon", ("torch",))
