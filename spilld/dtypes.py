"""Explicit mapping between mlx dtypes and the stable names written into files."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

from . import errors

_BY_NAME: dict[str, mx.Dtype] = {
    "bool": mx.bool_,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float16": mx.float16,
    "float32": mx.float32,
    "float64": mx.float64,
    "bfloat16": mx.bfloat16,
    "complex64": mx.complex64,
}
_BY_DTYPE: dict[mx.Dtype, str] = {v: k for k, v in _BY_NAME.items()}


def buffer(a: mx.array) -> memoryview:
    """The zero-copy buffer of an evaluated array (works for every dtype, bfloat16 included)."""
    return memoryview(cast(Any, a))


def name_of(dtype: mx.Dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise errors.UnsupportedCache(f"dtype {dtype} cannot be stored") from None


def dtype_of(name: str) -> mx.Dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise errors.HeaderMalformed(f"unknown dtype {name!r}") from None
