"""Codecs for the plain KV caches: KVCache, ConcatenateKVCache, ChunkedKVCache."""

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
    LiveSource,
    Source,
    expect_tensors,
    field,
    grown,
    new_instance,
    rows,
    view,
)


def _check_rows(entry: CacheEntry, n: int) -> None:
    for s in entry.tensors:
        if len(s.shape) != 4 or s.shape[2] != n:
            from .. import errors

            raise errors.HeaderMalformed(f"{entry.kind} tensor shape {s.shape} does not hold {n} rows")


class KVCacheCodec(Codec):
    """``KVCache``: keys/values sliced to ``offset`` (never the step padding).

    Loads with step capacity so the next decode step appends in place.
    """

    kind = "kv"
    grow = True
    snapshot = SNAPSHOT_ROWS  # updates write rows at and past the offset; growth copies the rows below it

    def cache_type(self) -> type:
        return C.KVCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        n = ctx.offset_of(cache)
        if cache.keys is None or n == 0:  # empty: no tensors (zero rows are never stored)
            return self.entry(offset=0, trimmable=True, arrays=[])
        arrays: list[Source | LiveSource]
        if ctx.live:
            arrays = [ctx.live_rows(cache, "keys", n), ctx.live_rows(cache, "values", n)]
        else:
            arrays = [rows(cache.keys, n), rows(cache.values, n)]
        return self.entry(offset=n, trimmable=True, arrays=arrays)

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        cache = self.cache_type()()
        expect_tensors(entry, 0, 2)
        if entry.tensors:
            n = entry.offset or 0
            _check_rows(entry, n)
            cap = grown(entry.tensors, C.KVCache.step) if self.grow else None
            cache.keys = ctx.read(entry.tensors[0], cap)
            cache.values = ctx.read(entry.tensors[1], cap)
            cache.offset = n
        return cache

    def live_arrays(self, cache: Any) -> list[Any]:
        return [] if cache.keys is None else [cache.keys, cache.values]

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        out = self.cache_type()()
        if cache.keys is not None:
            out.keys, out.values = view(cache.keys), view(cache.values)
            out.offset = cache.offset
        return out


class ConcatenateKVCodec(KVCacheCodec):
    """``ConcatenateKVCache``: sliced to ``offset``, so a trimmed cache stays trimmed."""

    kind = "concat"
    grow = False

    def cache_type(self) -> type:
        return C.ConcatenateKVCache

    def cut(self, cache: Any, n: int) -> None:
        # its trim lowers the offset only, and its next update concatenates onto every row kept: keep only the live
        cache.trim(n)
        if cache.keys is not None:
            cache.keys, cache.values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class ChunkedKVCodec(Codec):
    """``ChunkedKVCache``: the buffer holds tokens ``[start_position, offset)``.

    Those before ``start_position`` are gone, so the entry cannot be cut below it
    (its minimum reusable offset).
    """

    kind = "chunked"
    # snapshot: a clone (the default): maybe_trim_front moves the rows a snapshot would read

    def cache_type(self) -> type:
        return C.ChunkedKVCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        fields = {"chunk_size": cache.chunk_size, "start_position": cache.start_position}
        arrays = []
        n = cache.offset - cache.start_position
        if cache.keys is not None and n:
            arrays = [rows(cache.keys, n), rows(cache.values, n)]
        return self.entry(
            offset=cache.offset, trimmable=True, arrays=arrays, fields=fields, min_reusable=cache.start_position
        )

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        expect_tensors(entry, 0, 2)
        cache = C.ChunkedKVCache(field(entry, "chunk_size"))
        cache.start_position = field(entry, "start_position")
        cache.offset = entry.offset or 0
        if entry.tensors:
            n = cache.offset - cache.start_position
            _check_rows(entry, n)
            cap = grown(entry.tensors, C.ChunkedKVCache.step)
            cache.keys = ctx.read(entry.tensors[0], cap)
            cache.values = ctx.read(entry.tensors[1], cap)
        return cache

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        def init(out: Any) -> None:
            out.chunk_size, out.start_position, out.offset = cache.chunk_size, cache.start_position, cache.offset
            out.keys = out.values = None
            if cache.keys is not None:
                out.keys, out.values = view(cache.keys), view(cache.values)

        return new_instance(C.ChunkedKVCache, init)
