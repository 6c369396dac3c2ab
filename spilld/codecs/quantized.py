"""Codec for ``QuantizedKVCache``: packed weights, scales and biases for K and V."""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as C

from ..format import CacheEntry
from .base import (
    SNAPSHOT_ROWS,
    Codec,
    DecodeContext,
    EncodeContext,
    Encoded,
    expect_tensors,
    field,
    grown,
    rows,
    view,
)


def _rows(parts: tuple[Any, ...], n: int) -> list[Any]:
    # Groups run along head_dim, so cutting the token axis keeps every group whole.
    return [rows(p, n) for p in parts]


class QuantizedKVCodec(Codec):
    kind = "quantized"
    snapshot = SNAPSHOT_ROWS  # appends like KVCache: rows below the offset are never rewritten

    def cache_type(self) -> type:
        return C.QuantizedKVCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        fields = {"group_size": cache.group_size, "bits": cache.bits}
        arrays: list[Any] = []
        n = ctx.offset_of(cache)
        if cache.keys is None or n == 0:  # empty: no tensors (zero rows are never stored)
            pass
        elif ctx.live:
            arrays = [ctx.live_rows(cache, s, n, i) for s in ("keys", "values") for i in range(3)]
        else:
            arrays = [*_rows(cache.keys, n), *_rows(cache.values, n)]
        return self.entry(offset=n, trimmable=True, arrays=arrays, fields=fields)

    def live_arrays(self, cache: Any) -> list[Any]:
        return [] if cache.keys is None else [*cache.keys, *cache.values]

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        expect_tensors(entry, 0, 6)
        cache: Any = C.QuantizedKVCache(group_size=field(entry, "group_size"), bits=field(entry, "bits"))
        if entry.tensors:
            cache.offset = entry.offset or 0
            cap = grown(entry.tensors, C.QuantizedKVCache.step)
            parts = [ctx.read(s, cap) for s in entry.tensors]
            cache.keys, cache.values = tuple(parts[:3]), tuple(parts[3:])
        return cache

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        out: Any = C.QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        if cache.keys is not None:
            out.keys, out.values = tuple(map(view, cache.keys)), tuple(map(view, cache.values))
            out.offset = cache.offset
        return out
