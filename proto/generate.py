"""Generate the Python protobuf and gRPC modules from proto/ (used by `make proto` and by the
freshness test, so both run exactly the same protoc command).

The proto path is mapped onto the import package `ec_protocol._proto`, so generated modules import
each other as `ec_protocol._proto.ecd.v1...` instead of a top-level `ecd` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "ec_protocol/_proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules and their package __init__ files under out_root; return
    their paths."""
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE}={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    # Every directory from ec_protocol/_proto down to the modules is a regular package.
    package_root = out_root / PACKAGE
    for module in package_root.rglob("*_pb2*.py"):
        directory = module.parent
        while directory != package_root.parent:
            (directory / "__init__.py").touch()
            directory = directory.parent
    return sorted((out_root / PACKAGE).rglob("*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path.relative_to(out))
