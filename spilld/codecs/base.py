"""The codec contract: one codec per cache class, our schema in, mlx-lm object out.

A codec reads a cache's named attributes into a ``CacheEntry`` (typed fields,
tensor slots) plus the arrays to write, and rebuilds the object from an entry.
It never passes mlx-lm's ``state`` through, so an mlx-lm layout change cannot
change our files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .. import dtypes, errors
from ..format import DTYPE_SIZES, CacheEntry, Slot


@dataclass
class Encoded:
    """An entry to write and its tensor sources, in ``entry.walk_slots()`` order."""

    entry: CacheEntry
    sources: list[mx.array]


class DecodeContext(Protocol):
    def read(self, slot: Slot, capacity: int | None = None) -> mx.array:
        """Load one tensor; with ``capacity`` the axis -2 is grown to that many rows (zeros)."""
        ...

    def decode(self, entry: CacheEntry) -> Any:
        """Decode a nested entry with the same provider."""
        ...


class EncodeContext(Protocol):
    def encode(self, cache: Any) -> Encoded: ...

    def clone(self, cache: Any) -> Any: ...


def slot_for(a: mx.array) -> Slot:
    name = dtypes.name_of(a.dtype)
    n = DTYPE_SIZES[name]
    for d in a.shape:
        n *= d
    return Slot(off=0, nbytes=n, shape=tuple(a.shape), dtype=name)


def view(a: mx.array, n: int | None = None) -> mx.array:
    """A new lazy, zero-copy array node over ``a`` (its first ``n`` rows along axis -2).

    Always a new node: mlx updates such as ``a[i] = x`` or ``a += 1`` rebind the
    Python object in place, and a view must keep the data it was taken from.
    """
    if n is not None:
        return a[..., :n, :]
    return a[:] if a.ndim else a + 0


def step_capacity(n: int, step: int) -> int:
    """Room for the next decode step to append in place, as mlx-lm would allocate it."""
    return (n // step + 1) * step


class Codec:
    """Base class. Subclasses set ``kind``, ``version``, ``cache_type`` and override the hooks."""

    kind: str = ""
    version: int = 1
    # versions this codec can read; a new version adds to this, never removes
    reads: frozenset[int] = frozenset({1})

    def cache_type(self) -> type:
        raise NotImplementedError

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        raise NotImplementedError

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        raise NotImplementedError

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        raise NotImplementedError

    # helpers shared by the codecs

    def entry(
        self,
        *,
        offset: int | None,
        trimmable: bool,
        arrays: list[mx.array],
        fields: dict[str, Any] | None = None,
        min_reusable: int = 0,
    ) -> Encoded:
        e = CacheEntry(
            kind=self.kind,
            version=self.version,
            offset=offset,
            min_reusable=min_reusable,
            trimmable=trimmable,
            fields=fields or {},
            tensors=[slot_for(a) for a in arrays],
        )
        return Encoded(e, list(arrays))


def expect_tensors(entry: CacheEntry, *counts: int) -> None:
    if len(entry.tensors) not in counts:
        raise errors.HeaderMalformed(f"{entry.kind} entry has {len(entry.tensors)} tensors, expected {counts}")


def field(entry: CacheEntry, name: str, kind: type | tuple[type, ...] = int) -> Any:
    try:
        v = entry.fields[name]
    except KeyError:
        raise errors.HeaderMalformed(f"{entry.kind} entry lacks field {name!r}") from None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise errors.HeaderMalformed(f"{entry.kind}.{name} has type {type(v).__name__}")
    return v


def new_instance(cls: type, init: Callable[[Any], None]) -> Any:
    """Build a cache object without its ``__init__`` (its arguments are in our fields)."""
    obj = cls.__new__(cls)
    init(obj)
    return obj
