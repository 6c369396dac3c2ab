"""Codec for ``ArraysCache`` (SSM and conv state of hybrid models), ``None`` slots included."""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as C

from .. import errors
from ..format import CacheEntry
from .base import Codec, DecodeContext, EncodeContext, Encoded, field, new_instance, rows, view


def _opt(a: Any) -> Any:
    return None if a is None else view(a)


class ArraysCodec(Codec):
    """Recurrent state has no token axis: never trimmable, no offset of its own."""

    kind = "arrays"

    def cache_type(self) -> type:
        return C.ArraysCache

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        present = [c is not None for c in cache.cache]
        arrays = [rows(c) for c in cache.cache if c is not None]
        extras = {"left_padding": cache.left_padding, "lengths": cache.lengths}
        arrays += [rows(a) for a in extras.values() if a is not None]
        fields = {"slots": present, **{k: v is not None for k, v in extras.items()}}
        return self.entry(offset=None, trimmable=False, arrays=arrays, fields=fields)

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        present = field(entry, "slots", list)
        has_lp, has_len = field(entry, "left_padding", bool), field(entry, "lengths", bool)
        if not all(isinstance(p, bool) for p in present) or len(entry.tensors) != sum(present) + has_lp + has_len:
            raise errors.HeaderMalformed("arrays entry: slot map does not match its tensors")
        it = iter(entry.tensors)
        cache: Any = C.ArraysCache(len(present))
        slots: list[Any] = [ctx.read(next(it)) if p else None for p in present]
        cache.cache = slots
        cache.left_padding = ctx.read(next(it)) if has_lp else None
        cache.lengths = ctx.read(next(it)) if has_len else None
        return cache

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        def init(out: Any) -> None:
            out.cache = [_opt(c) for c in cache.cache]
            out.left_padding, out.lengths = _opt(cache.left_padding), _opt(cache.lengths)

        return new_instance(type(cache), init)
