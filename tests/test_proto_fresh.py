"""The generated protobuf modules in ec_protocol/_proto are what proto/ generates today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_match_the_proto_files(tmp_path: Path) -> None:
    generator = load_generator()
    generated = generator.generate(tmp_path)
    assert generated, "protoc generated nothing"
    for path in generated:
        relative = path.relative_to(tmp_path)
        committed = ROOT / relative
        assert committed.exists(), f"{relative} is not committed: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{relative} is stale: run `make proto`"
    proto_dir = ROOT / generator.PACKAGE
    # .py and .pyi only: a checkout that imported them holds __pycache__/*.pyc beside them
    committed_all = {
        p.relative_to(ROOT) for p in [*proto_dir.rglob("*.py"), *proto_dir.rglob("*.pyi")]
    }
    assert committed_all == {p.relative_to(tmp_path) for p in generated}, "extra generated files"
