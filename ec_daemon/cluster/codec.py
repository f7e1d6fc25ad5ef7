"""The cluster tier's keys and values: the format of vLLM's own encoder cache on Mooncake Store
(vLLM 0.33, `mooncake_store_embedding`), so that ecd nodes and plain vLLM engines share one
cache (docs/design.md §13).

- A key is `{namespace}@id:{key}` (vLLM's `make_embedding_key`), the key as text: ecd keys are
  bytes, and vLLM's identifiers reach ecd as their UTF-8, so a key that is UTF-8 is that text,
  as it is. A key that is not UTF-8 (no vLLM identifier is) goes under `{namespace}@ecd-hex:`
  and its hex digits, which vLLM never asks for.
- A value is a 24-byte little-endian header, `<IIQQ`: magic 0x4D4F4F4E, dtype code (0 float32,
  11 float16, 12 bfloat16), tokens, hidden size; then the tensor's bytes, row-major.

An entry that format cannot express (not 2-D, another dtype) is not published at all: vLLM could
not read it, and a framing of ecd's own would be a second format for the cluster to version and
test for a kind of entry no engine asks for yet.
"""

from __future__ import annotations

import struct

from ec_protocol.types import TensorSpec

HEADER = struct.Struct("<IIQQ")
MAGIC = 0x4D4F4F4E
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}
_DTYPE_BY_CODE = {code: name for name, code in DTYPE_CODES.items()}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class Unpublishable(ValueError):
    """An entry the format cannot express: it stays on its node."""


def store_key(namespace: str, key: bytes) -> str:
    """The key an entry `key` of a pool shared under `namespace` has in the store."""
    try:
        return f"{namespace}@id:{key.decode('utf-8')}"
    except UnicodeDecodeError:
        return f"{namespace}@ecd-hex:{key.hex()}"


def header(spec: TensorSpec) -> bytes:
    """The value's header for an entry of this spec; Unpublishable if the format lacks it."""
    code = DTYPE_CODES.get(spec.dtype)
    if code is None:
        raise Unpublishable(
            f"dtype {spec.dtype}: the store's format has float32, float16, bfloat16"
        )
    if len(spec.shape) != 2:
        raise Unpublishable(f"shape {spec.shape}: the store's format has 2-D entries only")
    tokens, hidden = spec.shape
    return HEADER.pack(MAGIC, code, tokens, hidden)


def parse_header(raw: bytes) -> TensorSpec:
    """The spec a value's header describes; ValueError if it is not one of the format's."""
    if len(raw) < HEADER.size:
        raise ValueError(f"{len(raw)} bytes: a header is {HEADER.size}")
    magic, code, tokens, hidden = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"magic {magic:#x}, expected {MAGIC:#x}")
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None:
        raise ValueError(f"dtype code {code}: expected one of {sorted(_DTYPE_BY_CODE)}")
    return TensorSpec((tokens, hidden), dtype, tokens * hidden * _ITEMSIZE[dtype])
