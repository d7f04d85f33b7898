"""Casting raw tensor bytes between floating dtypes without torch, exactly as ``tensor.to(dtype)``.

An export may write its weights in another dtype (``--dtype bf16``). numpy has no bfloat16, so a
bfloat16 value is handled as the upper half of a float32: widening shifts it up (exact), narrowing
rounds to nearest even on the lower 16 bits, which is what torch's conversion gives bit for bit for
every number (a NaN stays a NaN: torch's vectorised path writes 0xFFFF, its scalar path 0x7FC0, this
0x7FC0 with the sign). float16/32/64 are numpy's own (IEEE round to nearest even, as torch).
"""
from __future__ import annotations

import numpy as np

_NUMPY = {"float64": np.float64, "float32": np.float32, "float16": np.float16}


def _to_float32(data: memoryview, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, dtype=_NUMPY[dtype]).astype(np.float32)


def _float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    bits = values.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) & 0x8000 | 0x7FC0).astype(np.uint16)
    return rounded


def cast(data: memoryview, source: str, target: str) -> memoryview:
    """The bytes of ``data`` (``source`` dtype) as ``target``; ``data`` itself when they are the same."""
    if source == target:
        return data
    if target == "bfloat16":
        return memoryview(_float32_to_bfloat16(_to_float32(data, source))).cast("B")
    values = np.frombuffer(data, dtype=_NUMPY[source]) if source != "bfloat16" else _to_float32(data, source)
    with np.errstate(over="ignore"):  # out of range becomes inf, as in torch
        return memoryview(values.astype(_NUMPY[target])).cast("B")
