"""Live snapshots: what the engine's thread takes at the ``spill()`` call, and the plan the writer makes of it.

A live snapshot of an append-only cache reads its rows later, inside the lease (``LiveSource``). All it needs
from the call is each cache's offset and count of cuts (``AtCall``) and its buffers evaluated on the engine's
thread; entries, slots and shapes are bookkeeping the writer does off that thread. Classes whose rows are
overwritten in place are cloned and encoded at the call instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .base import SNAPSHOT_NESTED, SNAPSHOT_ROWS, AtCall, Encoded, LiveSource, Source, live_rows
from .registry import CodecProvider


class LiveCapture:
    """Take it on the engine's thread at the call; ``encode`` may run later on any thread.

    It pins the cache objects (not their buffers: the engine's next in-place update copies nothing) and, for
    classes snapshotted by a clone, the clone's views.
    """

    def __init__(self, provider: CodecProvider, caches: Sequence[Any]) -> None:
        self.provider = provider
        self.caches = list(caches)
        self._at: dict[int, tuple[Any, AtCall]] = {}  # id(cache) -> (cache, its state at the call)
        self._cloned: dict[int, tuple[Any, Encoded]] = {}  # id(cache) -> (cache, its clone's plan)
        self.arrays: list[mx.array] = []  # for the caller to evaluate on its own thread, in one call
        for c in self.caches:
            self._take(c)

    def _take(self, cache: Any) -> None:
        codec = self.provider.for_cache(cache)
        if codec.snapshot == SNAPSHOT_ROWS:
            self._at[id(cache)] = (cache, AtCall.of(cache))
            self.arrays.extend(codec.live_arrays(cache))
        elif codec.snapshot == SNAPSHOT_NESTED:
            for child in codec.children(cache):
                self._take(child)
        else:  # rows this class overwrites in place cannot be read later: a clone's plan, made now
            enc = codec.encode(self.provider.clone(cache), self.provider)
            self._cloned[id(cache)] = (cache, enc)
            self.arrays.extend(s.array for s in enc.sources if isinstance(s, Source))

    def encode(self) -> list[Encoded]:
        """Each cache's entry and sources, as at the call (the writer's side: reads no rows)."""
        ctx = _Context(self)
        return [ctx.encode(c) for c in self.caches]


class _Context:
    """The ``EncodeContext`` a capture's caches are planned in: offsets and cut counts from the call."""

    live = True

    def __init__(self, capture: LiveCapture) -> None:
        self._cap = capture

    def encode(self, cache: Any) -> Encoded:
        cloned = self._cap._cloned.get(id(cache))
        if cloned is not None:
            return cloned[1]
        return self._cap.provider.for_cache(cache).encode(cache, self)

    def clone(self, cache: Any) -> Any:
        return self._cap.provider.clone(cache)

    def offset_of(self, cache: Any) -> int:
        return self._cap._at[id(cache)][1].offset

    def live_rows(self, cache: Any, attr: str, n: int, part: int | None = None) -> LiveSource:
        return live_rows(cache, attr, n, part, self._cap._at[id(cache)][1])
