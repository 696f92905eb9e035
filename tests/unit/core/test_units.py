"""The one dtype-to-bytes table."""

from __future__ import annotations

import pytest

from llmopt.core.units import DTYPE_BYTES, dtype_bytes


def test_dtype_bytes_and_unknown_name():
    assert dtype_bytes("float32") == 4 and dtype_bytes("bfloat16") == dtype_bytes("float16") == 2
    assert dtype_bytes("fp8") == dtype_bytes("int8") == 1 and dtype_bytes("int4") == 0.5
    with pytest.raises(ValueError, match="unknown dtype 'fp16'; known: .*bfloat16.*int4"):
        dtype_bytes("fp16")
    assert set(DTYPE_BYTES) >= {"float32", "bfloat16", "float16", "fp8", "int8", "int4"}
