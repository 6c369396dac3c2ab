"""Codecs for the batched caches: ``BatchKVCache`` and ``BatchRotatingKVCache``.

Per-sequence ``offset`` and ``left_padding`` are arrays and travel as tensors;
scalar bookkeeping (``_idx``, ``_offset``, ``rotated``) is read by name into
typed fields (mlx-lm's own ``meta_state`` once turned ``rotated=False`` into True).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as C

from .. import errors
from ..format import CacheEntry
from .base import Codec, DecodeContext, EncodeContext, Encoded, field, grown, new_instance, rows, view


def _optional(entry: CacheEntry, it: Any, name: str, ctx: DecodeContext) -> Any:
    return ctx.read(next(it)) if field(entry, name, bool) else None


def _count(entry: CacheEntry, *flags: str) -> None:
    want = 2 + 2 * field(entry, "has_kv", bool) + sum(field(entry, f, bool) for f in flags)
    if len(entry.tensors) != want:
        raise errors.HeaderMalformed(f"{entry.kind} entry has {len(entry.tensors)} tensors, expected {want}")


class BatchKVCodec(Codec):
    kind = "batch_kv"

    def cache_type(self) -> type:
        return C.BatchKVCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        n = cache._idx
        arrays = [rows(cache.offset), rows(cache.left_padding)]
        has_kv = cache.keys is not None and n > 0  # zero rows are never stored
        if has_kv:
            arrays += [rows(cache.keys, n), rows(cache.values, n)]
        if cache._right_padding is not None:
            arrays.append(rows(cache._right_padding))
        fields = {"idx": n, "has_kv": has_kv, "right_padding": cache._right_padding is not None}
        return self.entry(offset=n, trimmable=True, arrays=arrays, fields=fields)

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        _count(entry, "right_padding")
        it = iter(entry.tensors)
        offset, left_padding = ctx.read(next(it)), ctx.read(next(it))
        idx = field(entry, "idx")
        keys = values = None
        if field(entry, "has_kv", bool):
            k, v = next(it), next(it)
            cap = grown([k, v], C.BatchKVCache.step)
            keys, values = ctx.read(k, cap), ctx.read(v, cap)
        right = _optional(entry, it, "right_padding", ctx)

        def init(c: Any) -> None:
            c.keys, c.values, c.offset, c.left_padding, c._idx, c._right_padding = (
                keys,
                values,
                offset,
                left_padding,
                idx,
                right,
            )

        return new_instance(C.BatchKVCache, init)

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        def init(c: Any) -> None:
            has = cache.keys is not None
            c.keys = view(cache.keys) if has else None
            c.values = view(cache.values) if has else None
            c.offset, c.left_padding, c._idx = view(cache.offset), view(cache.left_padding), cache._idx
            c._right_padding = None if cache._right_padding is None else view(cache._right_padding)

        return new_instance(C.BatchKVCache, init)


def _rot_rows(cache: Any) -> int:
    return min(cache._offset, cache.keys.shape[2])


class BatchRotatingKVCodec(Codec):
    kind = "batch_rotating"

    def cache_type(self) -> type:
        return C.BatchRotatingKVCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        arrays = [rows(cache.offset), rows(cache.left_padding)]
        has_kv = cache.keys is not None and _rot_rows(cache) > 0  # zero rows are never stored
        if has_kv:
            n = _rot_rows(cache)
            arrays += [rows(cache.keys, n), rows(cache.values, n)]
        if cache._lengths is not None:
            arrays.append(rows(cache._lengths))
        fields = {
            "max_size": cache.max_size,
            "pos": cache._offset,
            "idx": cache._idx,
            "rotated": bool(cache.rotated),
            "has_kv": has_kv,
            "lengths": cache._lengths is not None,
        }
        trimmable = cache._offset < cache.max_size
        return self.entry(offset=cache._offset, trimmable=trimmable, arrays=arrays, fields=fields)

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        _count(entry, "lengths")
        it = iter(entry.tensors)
        offset, left_padding = ctx.read(next(it)), ctx.read(next(it))
        kv = (ctx.read(next(it)), ctx.read(next(it))) if field(entry, "has_kv", bool) else (None, None)
        lengths = _optional(entry, it, "lengths", ctx)

        def init(c: Any) -> None:
            c.keys, c.values = kv
            c.offset, c.left_padding, c._lengths = offset, left_padding, lengths
            c.max_size, c._offset = field(entry, "max_size"), field(entry, "pos")
            c._idx, c.rotated = field(entry, "idx"), field(entry, "rotated", bool)

        return new_instance(C.BatchRotatingKVCache, init)

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        def init(c: Any) -> None:
            has = cache.keys is not None
            c.keys = view(cache.keys) if has else None
            c.values = view(cache.values) if has else None
            c.offset, c.left_padding = view(cache.offset), view(cache.left_padding)
            c._lengths = None if cache._lengths is None else view(cache._lengths)
            c.max_size, c._offset, c._idx, c.rotated = cache.max_size, cache._offset, cache._idx, cache.rotated

        return new_instance(C.BatchRotatingKVCache, init)
