"""The dtypes an entry may hold, by torch's names, and a tensor's size in bytes: pure Python, below
both the API's values (ec_protocol.types) and the pool file's format (ec_protocol.pool.layout),
whose slot records store each dtype's code."""

from __future__ import annotations

import math

# torch dtype name -> (code stored in slot records, itemsize). Codes are part of the file format:
# never renumber, only append.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "int16": (3, 2),
    "int32": (4, 4),
    "int64": (5, 8),
    "float16": (6, 2),
    "bfloat16": (7, 2),
    "float32": (8, 4),
    "float64": (9, 8),
    "bool": (10, 1),
    "float8_e4m3fn": (11, 1),
    "float8_e5m2": (12, 1),
    "float8_e4m3fnuz": (13, 1),
    "float8_e5m2fnuz": (14, 1),
    "uint16": (15, 2),
    "uint32": (16, 4),
    "uint64": (17, 8),
    "complex64": (18, 8),
    "complex128": (19, 16),
    "float8_e8m0fnu": (20, 1),  # MX scales
    "float4_e2m1fn_x2": (21, 1),  # two fp4 values an element (a byte)
}


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPES[dtype][1]
