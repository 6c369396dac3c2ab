"""The codec contract: one codec per cache class, our schema in, mlx-lm object out.

A codec reads a cache's named attributes into a ``CacheEntry`` (typed fields,
tensor slots) plus the arrays to write, and rebuilds the object from an entry.
It never passes mlx-lm's ``state`` through, so an mlx-lm layout change cannot
change our files.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .. import dtypes, errors
from ..format import DTYPE_SIZES, CacheEntry, Slot
from .rules import MLX_LM_RULES, KindRule, growth_allowed


@dataclass
class Source:
    """A tensor to write: ``array`` whole, or only its first ``rows`` along axis -2.

    Rows are cut by byte arithmetic on the evaluated buffer, never by an mlx
    op: mlx 0.32 cannot evaluate a graph built on another thread, and the
    write may run on a worker thread.
    """

    array: mx.array
    rows: int | None = None
    start: int = 0  # the first row stored (a block's rows start past the ones before it)

    @property
    def shape(self) -> tuple[int, ...]:
        s = tuple(self.array.shape)
        return s if self.rows is None else (*s[:-2], self.rows, s[-1])

    @property
    def dtype(self) -> mx.Dtype:
        return self.array.dtype

    def row_slice(self, start: int, rows: int) -> Source:
        """Rows ``[start, start + rows)`` of what this source stores."""
        return Source(self.array, rows, self.start + start)


@dataclass
class LiveSource:
    """The first ``rows`` rows of a buffer the engine keeps extending in place.

    It holds no reference to the buffer between steps (a held reference makes
    the engine's next in-place update copy the whole buffer); ``fetch`` reads
    the engine's current buffer inside the lease and the rows are copied out
    there. Valid only while the engine appends and never rewrites rows below
    ``rows``: a cut below it (seen in the offset, or through the cache's
    ``trim`` while the snapshot is pending, even if the engine grew back past
    it since) is detected and fails the save.
    """

    fetch: Callable[[], mx.array]
    rows: int
    full_shape: tuple[int, ...]
    dtype: mx.Dtype
    start: int = 0  # the first row stored (a block's rows start past the ones before it)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.full_shape[:-2], self.rows, self.full_shape[-1])

    def row_slice(self, start: int, rows: int) -> LiveSource:
        """Rows ``[start, start + rows)`` of what this source stores (read inside the lease, as the whole)."""
        return LiveSource(self.fetch, rows, self.full_shape, self.dtype, self.start + start)


# How a codec's cache class is snapshotted with ``live=True`` (``Codec.snapshot``).
SNAPSHOT_ROWS = "rows"  # append-only buffers: rows below the offset are read at write time, inside the lease
SNAPSHOT_CLONE = "clone"  # rows are overwritten in place (rings, windows, recurrent state): a clone at the call
SNAPSHOT_NESTED = "nested"  # a container: each child decides for itself


MAX_CUTS_REMEMBERED = 64  # cuts a cache's watch keeps; a snapshot older than all of them cannot rule out drift


class CutWatch:
    """Records the cuts (``trim`` calls that lowered the offset) of one cache.

    Installed once per cache object, its class's ``trim`` made to count them (mlx-lm's ``trim_prompt_cache`` and
    ``CacheList.trim`` call that): a cut followed by regrowth past a live snapshot's length rewrites rows the
    snapshot has yet to read, which the offset alone cannot show. A snapshot keeps the count of cuts at its call
    (``mark``) and asks for the lowest offset cut to since (``low_since``).
    """

    ATTR = "_spilld_cut_watch"

    def __init__(self, cache: Any, also: CutWatch | None = None) -> None:
        # weak: the cache holds its watch, so a strong reference back was a cycle that kept a dropped cache's
        # buffers until a full collection (found in review)
        self._cache = weakref.ref(cache)
        self._also = also  # the watch of the cache this one is a shallow copy of: they may share their arrays
        self._trimming = False  # a subclass's trim calling its base's counts one cut, not two
        self.cuts = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=MAX_CUTS_REMEMBERED)  # (cut number, offset after)

    def __getstate__(self) -> dict[str, Any]:  # a weak reference does not pickle: the cache itself does
        return {"cache": self._cache(), "cuts": self.cuts, "recent": list(self._recent)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._cache = weakref.ref(state["cache"])
        self._also, self._trimming = None, False
        self.cuts = state["cuts"]
        self._recent = deque(state["recent"], maxlen=MAX_CUTS_REMEMBERED)

    def __deepcopy__(self, memo: dict[int, Any]) -> CutWatch:
        """A deep copy of the cache copies its watch, watching the copy (which ``memo`` holds by then)."""
        cache = self._cache()
        out = CutWatch(memo.get(id(cache), cache))
        out.cuts, out._recent = self.cuts, deque(self._recent, maxlen=MAX_CUTS_REMEMBERED)
        return out

    @classmethod
    def of(cls, cache: Any) -> CutWatch:
        """The cache's watch, installed on first use (a shallow copy's counts its cuts for the original too)."""
        watch: CutWatch | None = getattr(cache, cls.ATTR, None)
        if watch is None or watch._cache() is not cache:
            watch = cls(cache, also=watch)
            setattr(cache, cls.ATTR, watch)
            _count_cuts(type(cache))
        return watch

    def mark(self) -> int:
        return self.cuts

    def low_since(self, mark: int) -> int | None:
        """The lowest offset cut to after ``mark``; None if none; -1 if too many cuts to tell."""
        if self.cuts - mark > len(self._recent):
            return -1
        return min((off for k, off in self._recent if k > mark), default=None)

    def record(self, offset: int) -> None:
        """A cut down to ``offset``."""
        self.cuts += 1
        self._recent.append((self.cuts, offset))
        if self._also is not None:
            self._also.record(offset)


_COUNTS_CUTS = "_spilld_counts_cuts"


def _count_cuts(cls: type) -> None:
    """Make ``cls.trim`` count the cuts of each object that carries a watch (any other calls it unchanged). On the
    class, not the object: an object's own ``trim`` was copied by ``copy.copy``, and the copy's trim then cut the
    original (found in review)."""
    here = cls.__dict__.get("trim")
    if here is not None and getattr(here, _COUNTS_CUTS, False):
        return
    inner = cls.trim  # type: ignore[attr-defined]
    inner = inner.__wrapped__ if getattr(inner, _COUNTS_CUTS, False) else inner  # a base class's, counted there

    @functools.wraps(inner)
    def trim(self: Any, n: int) -> Any:
        watch: CutWatch | None = getattr(self, CutWatch.ATTR, None)
        if watch is None or watch._trimming:
            return inner(self, n)
        before, watch._trimming = self.offset, True
        try:
            out = inner(self, n)
        finally:
            watch._trimming = False
        if self.offset < before:
            watch.record(self.offset)
        return out

    setattr(trim, _COUNTS_CUTS, True)
    cls.trim = trim  # type: ignore[attr-defined]


@dataclass(frozen=True)
class AtCall:
    """What a live snapshot keeps of a cache at the ``spill()`` call: its offset and its count of cuts."""

    offset: int
    watch: CutWatch
    mark: int

    @classmethod
    def of(cls, cache: Any) -> AtCall:
        watch = CutWatch.of(cache)
        return cls(cache.offset, watch, watch.mark())


def live_rows(cache: Any, attr: str, n: int, part: int | None = None, at: AtCall | None = None) -> LiveSource:
    """A LiveSource over ``cache.<attr>`` (or its ``part``-th array), first ``n`` rows.

    ``at`` is the cache's state at the snapshot point (taken now when not given):
    cuts made after it, even ones grown back past ``n``, fail the read. The
    caller evaluates the buffer on the engine's thread at that point
    (``LiveCapture`` does): a graph the engine left lazy can be evaluated by no
    other thread.
    """

    def current() -> mx.array:
        arr = getattr(cache, attr)
        return arr if part is None else arr[part]

    at = at or AtCall.of(cache)
    watch, mark = at.watch, at.mark

    def fetch() -> mx.array:
        arr = current()
        low = watch.low_since(mark)
        if cache.offset < n or arr.shape[-2] < n or (low is not None and low < n):
            raise errors.PlanDrift(f"the engine cut its cache below {n} tokens before the snapshot was written")
        return arr

    arr = current()
    return LiveSource(fetch, n, tuple(arr.shape), arr.dtype)


@dataclass
class Encoded:
    """An entry to write and its tensor sources, in ``entry.walk_slots()`` order."""

    entry: CacheEntry
    sources: list[Source | LiveSource]


class DecodeContext(Protocol):
    def read(self, slot: Slot, capacity: int | None = None) -> mx.array:
        """Load one tensor; with ``capacity`` the axis -2 is grown to that many rows (zeros)."""
        ...

    def decode(self, entry: CacheEntry) -> Any:
        """Decode a nested entry with the same provider."""
        ...


class EncodeContext(Protocol):
    live: bool  # plan a snapshot of caches the engine keeps extending (see LiveSource)

    def encode(self, cache: Any) -> Encoded: ...

    def clone(self, cache: Any) -> Any: ...

    def offset_of(self, cache: Any) -> int:
        """The cache's offset at the snapshot point (for a live snapshot planned later, the one at the call)."""
        ...

    def live_rows(self, cache: Any, attr: str, n: int, part: int | None = None) -> LiveSource:
        """``live_rows`` with the cache's state at the snapshot point."""
        ...


def slot_for(src: Source | LiveSource) -> Slot:
    name = dtypes.name_of(src.dtype)
    shape = src.shape
    return Slot(off=0, nbytes=DTYPE_SIZES[name] * math.prod(shape), shape=shape, dtype=name)


def rows(a: mx.array, n: int | None = None) -> Source:
    """Store the first ``n`` rows (axis -2) of ``a``; all of it when ``n`` is None."""
    if n is not None and (a.ndim < 2 or n > a.shape[-2] or n < 0):
        raise ValueError(f"cannot take {n} rows of shape {a.shape}")
    return Source(a, None if n is None or n == a.shape[-2] else n)


def view(a: mx.array) -> mx.array:
    """A new, zero-copy array node over ``a``'s whole buffer (lazy until evaluated).

    Always a new node: mlx updates such as ``a[i] = x`` or ``a += 1`` rebind the
    Python object in place, and a clone must keep the data it was taken from.
    """
    return a[:] if a.ndim else a.reshape(())


def step_capacity(n: int, step: int) -> int:
    """Room for the next decode step to append in place, as mlx-lm would allocate it."""
    return (n // step + 1) * step


def grown(slots: Sequence[Slot], step: int) -> int | None:
    """The rows to load a cache's growing tensors with, one for all: their stored rows (never a header's offset
    or index) rounded up past the next step. None, and every tensor loads as stored, for empty tensors (a file pays
    for the rows it holds, so zero rows never buy a step of the other dimensions: mlx-lm grows it on use) and when
    any of them may not grow that far (``growth_allowed``): found in review, keys grown and values not (wider rows)
    made mlx-lm's next update, which checks the keys' capacity only, drop a value row."""
    rows = {s.shape[-2] if len(s.shape) >= 2 else 0 for s in slots}
    if len(rows) != 1 or not (n := rows.pop()):
        return None
    cap = step_capacity(n, step)
    return cap if all(growth_allowed(s, cap) for s in slots) else None


class Codec:
    """Base class. Subclasses set ``kind``, ``version``, ``cache_type`` and override the hooks."""

    kind: str = ""
    version: int = 1
    # How ``live=True`` snapshots this class (SNAPSHOT_*). The safe default for a class
    # we know nothing about: a clone at the call.
    snapshot: str = SNAPSHOT_CLONE
    # versions this codec can read; a new version adds to this, never removes
    reads: frozenset[int] = frozenset({1})

    @property
    def rule(self) -> KindRule | None:
        """What this codec's entries promise, as data (``spilld.codecs.rules``); None: unchecked."""
        return MLX_LM_RULES.get(self.kind)

    def cache_type(self) -> type:
        raise NotImplementedError

    def encode(self, cache: Any, ctx: EncodeContext) -> Encoded:
        raise NotImplementedError

    def decode(self, entry: CacheEntry, ctx: DecodeContext) -> Any:
        raise NotImplementedError

    def clone(self, cache: Any, ctx: EncodeContext) -> Any:
        raise NotImplementedError

    def live_arrays(self, cache: Any) -> list[mx.array]:
        """SNAPSHOT_ROWS: the buffers a live snapshot reads later (evaluated on the engine's thread at the call)."""
        return []

    def children(self, cache: Any) -> Sequence[Any]:
        """SNAPSHOT_NESTED: the caches inside this one."""
        return ()

    def cut(self, cache: Any, n: int) -> None:
        """A loaded cache cut back by ``n`` tokens (a restore of a shorter prefix): the class's own ``trim``."""
        cache.trim(n)

    # helpers shared by the codecs

    def entry(
        self,
        *,
        offset: int | None,
        trimmable: bool,
        arrays: Sequence[Source | LiveSource | mx.array],
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
            tensors=[],
        )
        sources = [a if isinstance(a, (Source, LiveSource)) else Source(a) for a in arrays]
        e.tensors = [slot_for(s) for s in sources]
        return Encoded(e, sources)


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


def new_instance(cls: Any, init: Callable[[Any], None]) -> Any:
    """Build a cache object without its ``__init__`` (its arguments are in our fields)."""
    obj = cls.__new__(cls)
    init(obj)
    return obj
