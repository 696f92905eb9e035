"""Bytes per element of every dtype llmopt plans, quantizes or measures: the one table.

Names are the torch-style names config.json and recipes use ("bfloat16"), plus the short names of
quantized formats ("fp8", "int4"). Safetensors header codes ("BF16") map onto the same names.

>>> dtype_bytes("bfloat16"), dtype_bytes("int4")
(2, 0.5)
"""

from __future__ import annotations

__all__ = ["DTYPE_BYTES", "SAFETENSORS_DTYPES", "dtype_bytes"]

DTYPE_BYTES: dict[str, float] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "int4": 0.5,
}
# Safetensors header dtype code -> name in DTYPE_BYTES.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of `name` ("int4" is half a byte).

    Raises:
        ValueError: an unknown name; the message lists the known ones.

    >>> dtype_bytes("fp16")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown dtype 'fp16'; known: float64, float32, bfloat16, ...
    """
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None
