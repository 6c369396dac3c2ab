"""Codec for ``RotatingKVCache``: the ring as laid out, plus its write index."""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as C

from ..format import CacheEntry
from .base import (
    SNAPSHOT_CLONE,
    Codec,
    DecodeContext,
    EncodeContext,
    Encoded,
    expect_tensors,
    field,
    new_instance,
    rows,
    view,
)


def _stored_rows(cache: Any) -> int:
    # Before the ring fills the buffer carries step padding past ``offset``.
    return min(cache.offset, cache.keys.shape[2])


class RotatingKVCodec(Codec):
    """Trimmable only before the ring wraps (``offset < max_size``), as in mlx-lm."""

    kind = "rotating"
    # A ring overwrites its oldest rows in place once it wraps (and a prefill reorders them), so a
    # live snapshot can never read it later: it is cloned at the call.
    snapshot = SNAPSHOT_CLONE

    def cache_type(self) -> type:
        return C.RotatingKVCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        fields = {"keep": cache.keep, "max_size": cache.max_size, "idx": cache._idx}
        arrays = []
        if cache.keys is not None and _stored_rows(cache):
            n = _stored_rows(cache)
            arrays = [rows(cache.keys, n), rows(cache.values, n)]
        return self.entry(offset=cache.offset, trimmable=cache.offset < cache.max_size, arrays=arrays, fields=fields)

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        expect_tensors(entry, 0, 2)
        cache = C.RotatingKVCache(field(entry, "max_size"), keep=field(entry, "keep"))
        cache.offset = entry.offset or 0
        cache._idx = field(entry, "idx")
        if entry.tensors:
            cache.keys = ctx.read(entry.tensors[0])
            cache.values = ctx.read(entry.tensors[1])
        return cache

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        def init(out: Any) -> None:
            out.keep, out.max_size, out.offset, out._idx = cache.keep, cache.max_size, cache.offset, cache._idx
            out.keys = out.values = None
            if cache.keys is not None:
                out.keys, out.values = view(cache.keys), view(cache.values)

        return new_instance(C.RotatingKVCache, init)
