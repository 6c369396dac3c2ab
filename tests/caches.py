"""Caches filled through the classes' own ``update_and_fetch``, and comparisons."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C


def kv(
    n: int, *, heads: int = 2, dim: int = 8, batch: int = 1, seed: int = 0, dtype: Any = mx.float32
) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    k = mx.random.normal((batch, heads, n, dim)).astype(dtype)
    v = mx.random.normal((batch, heads, n, dim)).astype(dtype)
    return k, v


def fill(cache: Any, n: int, *, chunk: int = 0, seed: int = 0, **kw: Any) -> Any:
    """Feed ``n`` tokens: one prefill of ``n - chunk`` then ``chunk`` single-token steps."""
    pre = n - chunk
    if pre:
        cache.update_and_fetch(*kv(pre, seed=seed, **kw))
    for i in range(chunk):
        cache.update_and_fetch(*kv(1, seed=seed + 1 + i, **kw))
    mx.eval(*[a for a in _arrays(cache)])
    return cache


def _arrays(obj: Any) -> list[mx.array]:
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in _arrays(x)]
    if isinstance(obj, C.CacheList):
        return _arrays(list(obj.caches))
    if isinstance(obj, C.ArraysCache):
        return _arrays([obj.cache, obj.left_padding, obj.lengths])
    out = []
    for name in ("keys", "values", "offset", "left_padding", "_right_padding", "_lengths"):
        v = getattr(obj, name, None)
        out += _arrays(v) if v is not None and not isinstance(v, int) else []
    return out


def live(cache: Any) -> Any:
    """What a cache presents to attention: the logical state, padding excluded."""
    if isinstance(cache, C.CacheList):
        return [live(c) for c in cache.caches]
    if isinstance(cache, C.ArraysCache):
        return [cache.cache, cache.left_padding, cache.lengths]
    if isinstance(cache, (C.BatchKVCache,)):
        k = None if cache.keys is None else (cache.keys[..., : cache._idx, :], cache.values[..., : cache._idx, :])
        return [k, cache.offset, cache.left_padding, cache._idx]
    if isinstance(cache, C.BatchRotatingKVCache):
        k = None if cache.keys is None else cache.keys_and_values()
        return [k, cache.offset, cache.left_padding, cache._offset, cache._idx, bool(cache.rotated), cache.max_size]
    scalars = {
        n: getattr(cache, n)
        for n in ("offset", "keep", "max_size", "_idx", "chunk_size", "start_position", "group_size", "bits")
        if hasattr(cache, n)
    }
    if cache.keys is None:
        return [None, scalars]
    if isinstance(cache, C.ChunkedKVCache):
        return [cache.keys_and_values(), scalars]
    if isinstance(cache, C.RotatingKVCache):
        n = min(cache.offset, cache.keys.shape[2])
        return [(cache.keys[..., :n, :], cache.values[..., :n, :]), scalars]
    return [cache.keys_and_values(), scalars]


def same(a: Any, b: Any) -> bool:
    """Exact structural equality of nested arrays / scalars (dtype and shape included)."""
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        if not (isinstance(a, mx.array) and isinstance(b, mx.array)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b) and type(a) is type(b)


def chunked(n: int) -> Any:
    """A ChunkedKVCache of ``n`` tokens whose front was trimmed away (start_position > 0)."""
    c = C.ChunkedKVCache(chunk_size=8)
    fill(c, n - 4)
    for i in range(4):
        c.maybe_trim_front()
        c.update_and_fetch(*kv(1, seed=20 + i))
    return c
