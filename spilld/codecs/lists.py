"""Codec for ``CacheList``: nested entries, each with its own codec."""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as C

from .. import errors
from ..format import CacheEntry
from .base import SNAPSHOT_NESTED, Codec, DecodeContext, EncodeContext, Encoded


class CacheListCodec(Codec):
    kind = "list"
    snapshot = SNAPSHOT_NESTED

    def cache_type(self) -> type:
        return C.CacheList

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        parts = [ctx.encode(c) for c in cache.caches]
        offsets = [p.entry.offset for p in parts if p.entry.offset is not None]
        entry = CacheEntry(
            kind=self.kind,
            version=self.version,
            offset=max(offsets) if offsets else None,
            min_reusable=max((p.entry.min_reusable for p in parts), default=0),
            trimmable=all(p.entry.trimmable for p in parts),
            children=[p.entry for p in parts],
        )
        return Encoded(entry, [a for p in parts for a in p.sources])

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        if entry.tensors:
            raise errors.HeaderMalformed("list entry carries tensors of its own")
        return C.CacheList(*(ctx.decode(c) for c in entry.children))

    def children(self, cache: Any) -> list[Any]:
        return list(cache.caches)

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        return C.CacheList(*(ctx.clone(c) for c in cache.caches))
