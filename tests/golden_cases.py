"""Deterministic caches (no RNG) behind the golden files in tests/data/.

Data comes from ``mx.arange`` so the expected values never depend on mlx's
random generator. Changing a builder invalidates its golden file: add a new
case instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C


def _kv(
    n: int, *, start: int = 0, heads: int = 2, dim: int = 4, batch: int = 1, dtype: Any = mx.float32
) -> tuple[mx.array, mx.array]:
    size = batch * heads * n * dim
    k = ((mx.arange(size) + start) % 251).reshape(batch, heads, n, dim).astype(dtype) / 8
    v = ((mx.arange(size) * 3 + start) % 241).reshape(batch, heads, n, dim).astype(dtype) / 16
    return k, v


def _feed(cache: Any, n: int, singles: int = 0, **kw: Any) -> Any:
    cache.update_and_fetch(*_kv(n - singles, **kw))
    for i in range(singles):
        cache.update_and_fetch(*_kv(1, start=1000 + i, **kw))
    return cache


def _arrays() -> Any:
    c = C.ArraysCache(3)
    c[0] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    c[2] = (mx.arange(8, dtype=mx.float32).reshape(1, 2, 4) / 3).astype(mx.bfloat16)
    return c


def _chunked() -> Any:
    c = C.ChunkedKVCache(chunk_size=4)
    _feed(c, 6)
    for i in range(3):
        c.maybe_trim_front()
        c.update_and_fetch(*_kv(1, start=50 + i))
    return c


def _batch_rot() -> Any:
    c = C.BatchRotatingKVCache(max_size=4, left_padding=[1, 0])
    c.update_and_fetch(*_kv(3, batch=2))
    for i in range(3):
        c.update_and_fetch(*_kv(1, start=70 + i, batch=2))
    return c


GOLDEN: dict[str, Callable[[], list[Any]]] = {
    "kv": lambda: [_feed(C.KVCache(), 9, singles=2), _feed(C.KVCache(), 9, dtype=mx.float16)],
    "concat": lambda: [_feed(C.ConcatenateKVCache(), 5, singles=1)],
    "chunked": lambda: [_chunked()],
    "rotating": lambda: [_feed(C.RotatingKVCache(6, keep=1), 4), _feed(C.RotatingKVCache(4, keep=1), 9, singles=6)],
    "quantized": lambda: [_feed(C.QuantizedKVCache(32, 4), 5, dim=32), _feed(C.QuantizedKVCache(32, 8), 5, dim=32)],
    "arrays": lambda: [_arrays()],
    "list": lambda: [C.CacheList(_arrays(), _feed(C.KVCache(), 3))],
    "batch_kv": lambda: [C.BatchKVCache.merge([_feed(C.KVCache(), 3), _feed(C.KVCache(), 5)])],
    "batch_rotating": lambda: [_batch_rot()],
}

GOLDEN_TOKENS = list(range(100, 109))
