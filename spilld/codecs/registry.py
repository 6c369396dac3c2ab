"""An explicit codec registry. Classes are matched by exact type; kinds by name.

A file never chooses the class to build: its ``kind`` is looked up in this
table, and the table's id (the codec provider) must match the file's before
anything is allocated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import errors
from ..format import CacheEntry
from .rules import MLX_LM_PROVIDER_ID, register_rules

if TYPE_CHECKING:
    from .base import Codec, Encoded, LiveSource


class CodecProvider:
    """A named, immutable table of codecs. Extend it to add an engine's own cache classes."""

    live = False

    def __init__(self, provider_id: str, codecs: Iterable[Codec]) -> None:
        if not provider_id:
            raise ValueError("a codec provider needs a non-empty id")
        self.id = provider_id
        self._by_kind: dict[str, Codec] = {}
        self._by_type: dict[type, Codec] = {}
        for c in codecs:
            if c.kind in self._by_kind:
                raise ValueError(f"codec kind {c.kind!r} registered twice")
            self._by_kind[c.kind] = c
            self._by_type[c.cache_type()] = c
        # Its codecs' rules, registered for this process's readers under its id (a kind with no rule is taken as
        # its codec reads it). Here, not only in ``extended``: found in review, a provider built directly from the
        # built-in codecs had none, so its files skipped §5.1 and its chunked caches were cut short of a chunk.
        table = {k: c.rule for k, c in self._by_kind.items() if c.rule is not None}
        if table:
            register_rules(provider_id, table, frozenset(k for k, c in self._by_kind.items() if c.rule is None))

    def extended(self, provider_id: str, codecs: Iterable[Codec]) -> CodecProvider:
        """A new provider with these codecs added (a new id: files name the table they need). Its rules are its
        codecs' (``rule``): this provider's and each added one's, registered for this process's readers."""
        return CodecProvider(provider_id, [*self._by_kind.values(), *codecs])

    def for_cache(self, cache: Any) -> Codec:
        try:
            return self._by_type[type(cache)]
        except KeyError:
            raise errors.UnsupportedCache(
                f"codec provider {self.id!r} has no codec for {type(cache).__qualname__}"
            ) from None

    def encode(self, cache: Any) -> Encoded:
        """Plan one cache: its entry and the (lazy) arrays to write. Materializes nothing."""
        return self.for_cache(cache).encode(cache, self)

    def clone(self, cache: Any) -> Any:
        """A zero-copy clone: a new object of the same class holding views of the same buffers."""
        return self.for_cache(cache).clone(cache, self)

    def offset_of(self, cache: Any) -> int:
        off: int = cache.offset
        return off

    def live_rows(self, cache: Any, attr: str, n: int, part: int | None = None) -> LiveSource:
        from .base import live_rows  # the codecs are mlx's: this runs engine-side only

        return live_rows(cache, attr, n, part)

    def for_entry(self, entry: CacheEntry, path: str | None = None) -> Codec:
        codec = self._by_kind.get(entry.kind)
        if codec is None:
            raise errors.UnknownCacheKind(f"codec provider {self.id!r} knows no cache kind {entry.kind!r}", path=path)
        if entry.version not in codec.reads:
            raise errors.CodecVersionUnsupported(
                f"{entry.kind} codec version {entry.version} (readable: {sorted(codec.reads)})", path=path
            )
        return codec

    def check_entries(self, entries: Iterable[CacheEntry], path: str | None = None) -> None:
        """Every entry, nested ones included, has a codec that reads its version."""
        for e in entries:
            self.for_entry(e, path)
            self.check_entries(e.children, path)

    @property
    def kinds(self) -> list[str]:
        return sorted(self._by_kind)


_default: CodecProvider | None = None


def default_provider() -> CodecProvider:
    """The codecs for every mlx-lm 0.32 cache class (imports mlx-lm on first use)."""
    global _default
    if _default is None:
        from .arrays import ArraysCodec
        from .batch import BatchKVCodec, BatchRotatingKVCodec
        from .kv import ChunkedKVCodec, ConcatenateKVCodec, KVCacheCodec
        from .lists import CacheListCodec
        from .quantized import QuantizedKVCodec
        from .rotating import RotatingKVCodec

        _default = CodecProvider(
            MLX_LM_PROVIDER_ID,
            [
                KVCacheCodec(),
                ConcatenateKVCodec(),
                ChunkedKVCodec(),
                RotatingKVCodec(),
                QuantizedKVCodec(),
                ArraysCodec(),
                CacheListCodec(),
                BatchKVCodec(),
                BatchRotatingKVCodec(),
            ],
        )
    return _default
