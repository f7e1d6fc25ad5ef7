"""The cluster tier's key and value format (ec_daemon/cluster/codec.py, docs/design.md §13).
That it is vLLM's own, byte for byte, is tests/cluster/test_codec_vllm.py's (it imports vLLM)."""

from __future__ import annotations

import struct

import pytest

from ec_daemon.cluster import codec
from ec_protocol.types import TensorSpec


def test_a_utf8_key_is_its_text_after_the_namespace_and_id() -> None:
    assert codec.store_key("ns@protocol:v3", "ab12-é".encode()) == "ns@protocol:v3@id:ab12-é"


def test_a_key_that_is_not_utf8_goes_in_hex_under_a_prefix_vllm_never_asks_for() -> None:
    assert codec.store_key("ns", b"\xff\x00a") == "ns@ecd-hex:ff0061"


@pytest.mark.parametrize(("dtype", "code"), [("float32", 0), ("float16", 11), ("bfloat16", 12)])
def test_a_2d_entry_header_is_magic_dtype_code_tokens_and_width(dtype: str, code: int) -> None:
    spec = TensorSpec((576, 4096), dtype, 576 * 4096 * (4 if dtype == "float32" else 2))
    raw = codec.header(spec)
    assert struct.unpack("<IIQQ", raw) == (0x4D4F4F4E, code, 576, 4096)
    assert codec.parse_header(raw) == spec


@pytest.mark.parametrize(
    "spec",
    [TensorSpec((2, 3, 4), "bfloat16", 48), TensorSpec((8,), "float32", 32),
     TensorSpec((4, 4), "int8", 16)],
)  # fmt: skip
def test_an_entry_the_format_cannot_express_is_unpublishable(spec: TensorSpec) -> None:
    with pytest.raises(codec.Unpublishable):
        codec.header(spec)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (struct.pack("<IIQQ", 0x45434431, 12, 1, 1), "magic"),
        (struct.pack("<IIQQ", 0x4D4F4F4E, 7, 1, 1), "dtype code 7"),
        (b"NOOM", "4 bytes"),
    ],
)
def test_a_header_that_is_not_the_formats_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        codec.parse_header(raw)
