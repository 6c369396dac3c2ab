"""One tensor's bytes as a save writes them: plain bytes a client sent (``BytesSource``), zero-copy runs of an
evaluated mlx array, or rows copied out of a live cache the engine keeps extending (``TensorBytes``).

mlx is imported only where an engine's arrays are touched: the daemon writes ``BytesSource`` without it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeGuard, cast

import numpy as np
import xxhash

from .. import errors
from .. import format as fmt
from ..bytecopy import copy_into
from ..lease import RunStep

if TYPE_CHECKING:
    import mlx.core as mx

    from ..codecs.base import LiveSource, Source


@dataclass
class BytesSource:
    """Tensor bytes that are already plain bytes, in one or more pieces (the daemon writes what a client sent)."""

    chunks: list[bytes | bytearray | memoryview]
    shape: tuple[int, ...]
    base: int = 0  # the entry row its first row is (a client sends no rows of the blocks the daemon holds)

    def row_slice(self, start: int, rows: int) -> BytesSource:
        """Entry rows ``[start, start + rows)`` (axis -2), as views of these chunks (a block cut from a received
        tensor)."""
        if start < self.base:
            raise ValueError(f"rows from {start} asked of received bytes that start at row {self.base}")
        total = sum(len(c) for c in self.chunks)
        count = math.prod(self.shape)
        itemsize = total // count if count else 0
        spans = fmt.row_spans(self.shape, itemsize, rows, start - self.base)
        return BytesSource(
            _cut_runs([memoryview(c).cast("B") for c in self.chunks], spans), (*self.shape[:-2], rows, self.shape[-1])
        )


def _cut_runs(runs: list[memoryview], spans: list[tuple[int, int]]) -> list[bytes | bytearray | memoryview]:
    """The byte ``spans`` (start, length; increasing) of the concatenation of ``runs``, as views."""
    out: list[bytes | bytearray | memoryview] = []
    pos, k = 0, 0
    for lo, n in spans:
        hi = lo + n
        while k < len(runs) and pos + runs[k].nbytes <= lo:
            pos += runs[k].nbytes
            k += 1
        p, j = pos, k
        while j < len(runs) and p < hi:
            r = runs[j]
            a, b = max(lo, p), min(hi, p + r.nbytes)
            if a < b:
                out.append(r[a - p : b - p])
            if p + r.nbytes > hi:
                break
            p += r.nbytes
            j += 1
    return out


AnySource: TypeAlias = "Source | LiveSource | BytesSource"


def _is_live(src: AnySource) -> TypeGuard[LiveSource]:
    from ..codecs.base import LiveSource

    return isinstance(src, LiveSource)


def array_sources(sources: Sequence[AnySource]) -> list[mx.array]:
    from ..codecs.base import Source

    return [s.array for s in sources if isinstance(s, Source)]


class Staging:
    """A reused host buffer for rows copied out of a live cache (fresh pages are slow to fault in)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def take(self, n: int) -> memoryview:
        if self._buf.nbytes < n:
            self._buf = np.empty(max(n, 2 * self._buf.nbytes), dtype=np.uint8)
        return memoryview(self._buf.data)[:n]


def byte_runs(src: Source) -> tuple[list[memoryview], mx.array]:
    """Zero-copy byte runs of the rows to store, in C order, plus the array they borrow."""
    import mlx.core as mx

    from .. import dtypes

    a = src.array
    if a.nbytes == 0:
        return [], a
    mv = dtypes.buffer(a)
    if not mv.c_contiguous:
        # Rare (a strided view); a contiguous copy, built and evaluated on this thread.
        mv.release()
        a = mx.contiguous(a)
        mx.eval(a)
        mv = dtypes.buffer(a)
    flat = mv.cast("B")
    mv.release()
    runs = [flat[o : o + n] for o, n in fmt.row_spans(a.shape, a.itemsize, src.rows, src.start)]
    flat.release()
    return runs, a


LIVE_CHUNK_BYTES = 2 * 1024 * 1024  # rows copied out of a live cache per lease hold (save_async)
# A live snapshot whose engine leaves its buffer unevaluated at every lease hold for this long fails
# (only the engine's thread can evaluate it; an engine that evaluates each step never gets near this).
LIVE_LAZY_TIMEOUT_S = 30.0
LIVE_RETRY_S = 0.002  # the pause before the next hold when the last one found the buffer unevaluated


class _NotEvaluated(Exception):
    """The engine's current buffer is a graph it has not evaluated yet (only its own thread can)."""


def _evaluated_runs(a: mx.array, n: int, start: int = 0) -> tuple[list[memoryview], mx.array]:
    """``byte_runs`` of an engine buffer read from another thread; ``_NotEvaluated`` if it is still lazy.

    Reading a lazy array evaluates it, which fails off the thread that built it
    and leaves the graph as it was: the next hold, after the engine's next
    step, finds it evaluated.
    """
    from ..codecs.base import Source

    try:
        return byte_runs(Source(a, n, start))
    except RuntimeError as exc:
        if "Stream" not in str(exc):
            raise
        raise _NotEvaluated(str(exc)) from None


def _copy_live_rows(src: LiveSource, out: memoryview, start: int, limit: int | None) -> int:
    """Copy the live rows' bytes ``[start, start + limit)`` into ``out``; return the new position.

    The engine's current buffer is fetched each time (it may have grown into a
    new one between two calls; the first ``rows`` rows are the same in both),
    and no reference to it survives the call.
    """
    a = src.fetch()
    if tuple(a.shape[:-2]) != src.full_shape[:-2] or a.shape[-1] != src.full_shape[-1] or a.dtype != src.dtype:
        raise errors.PlanDrift(f"live buffer changed shape: planned {src.full_shape}, now {tuple(a.shape)}")
    runs, held = _evaluated_runs(a, src.rows, src.start)
    end = out.nbytes if limit is None else min(out.nbytes, start + limit)
    pos = 0
    for r in runs:
        lo, hi = max(start, pos), min(end, pos + r.nbytes)
        if lo < hi:
            copy_into(out[lo:hi], r[lo - pos : hi - pos])
        pos += r.nbytes
        r.release()
    del held, a
    return end


class TensorBytes:
    """One tensor's bytes, taken from its source: zero-copy runs, or rows copied out of a live cache."""

    def __init__(self, index: int, slot: fmt.Slot, source: AnySource, staging: Staging | None) -> None:
        self.index = index
        self.slot = slot
        self._source: AnySource | None = source
        self._staging = staging
        self.runs: list[memoryview] = []
        self._held: mx.array | None = None
        self.ready = False
        self._live_out: memoryview | None = None
        self._live_pos = 0
        self.stalled_since: float | None = None  # the last hold found the live buffer unevaluated

    @property
    def released(self) -> bool:
        return self._source is None

    @property
    def borrowed(self) -> bool:
        """Its runs are the reused staging buffer's (rows copied out of a live cache): the next live tensor taken
        writes over them, so whatever must outlive that takes a copy."""
        return self._live_out is not None

    @property
    def engine_free(self) -> bool:
        """Plain bytes (what the daemon received): taking them touches nothing of an engine's."""
        return isinstance(self._source, BytesSource)

    def take(self, limit: int | None = None) -> bool:
        """Do at most ``limit`` bytes of the engine-touching work; True once ``runs`` holds every byte.

        Only a live source is split (its rows are copied out); any other source is done in one call.
        """
        src = self._source
        if src is None or self.ready:
            raise errors.SaveAborted("tensor bytes already taken")
        if src.shape != self.slot.shape:
            self.release()
            raise errors.PlanDrift(f"tensor {self.index}: planned shape {self.slot.shape}, got {src.shape}")
        if isinstance(src, BytesSource):
            self.runs = [memoryview(c).cast("B") for c in src.chunks if len(c)]
        elif _is_live(src):
            if self._live_out is None:
                self._live_out = (self._staging or Staging()).take(self.slot.nbytes)
            try:
                self._live_pos = _copy_live_rows(src, self._live_out, self._live_pos, limit)
                self.stalled_since = None
            except _NotEvaluated:
                return self._stalled()
            except BaseException:
                self.release()
                raise
            if self._live_pos < self._live_out.nbytes:
                return False
            self.runs = [self._live_out] if self._live_out.nbytes else []
        else:
            self.runs, self._held = byte_runs(cast("Source", src))
        self.ready = True
        got = sum(r.nbytes for r in self.runs)
        if got != self.slot.nbytes:
            self.release()
            raise errors.PlanDrift(f"tensor {self.index}: planned {self.slot.nbytes} bytes, got {got}")
        return True

    def _stalled(self) -> bool:
        """No progress this hold; past ``LIVE_LAZY_TIMEOUT_S`` of none the snapshot fails."""
        now = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = now
        elif now - self.stalled_since > LIVE_LAZY_TIMEOUT_S:
            self.release()
            raise errors.PlanDrift(
                f"tensor {self.index}: the engine left its live buffer unevaluated at every hold for"
                f" {LIVE_LAZY_TIMEOUT_S:g} s; the snapshot cannot be read"
            )
        return False

    async def take_in_lease(
        self, lease: RunStep, chunk: int = LIVE_CHUNK_BYTES, take: Callable[[int | None], bool] | None = None
    ) -> None:
        """Take every byte through ``lease``, ``chunk`` bytes per hold, letting the engine run between holds.
        ``take``: what each hold calls instead of ``self.take`` (a step's own ``materialize_part``)."""
        while not await lease(functools.partial(take or self.take, chunk)):
            await asyncio.sleep(LIVE_RETRY_S if self.stalled_since is not None else 0)

    def runs_now(self) -> list[memoryview]:
        """Take every byte at once (no lease) and return the runs."""
        while not self.take(None):
            pass
        return self.runs

    def digest(self) -> bytes:
        h = xxhash.xxh3_64()
        for r in self.runs:
            h.update(r)
        return h.digest()

    def release(self) -> None:
        """Drop every view and reference (idempotent)."""
        for r in self.runs:
            r.release()
        self.runs, self._held, self._source, self._live_out = [], None, None, None
