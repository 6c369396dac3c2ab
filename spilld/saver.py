"""The saver: a generator of steps, so a driver decides when each write happens.

``save_steps`` plans the file first (no bytes materialized; hashes are
placeholders of fixed width), then yields one ``TensorStep`` per tensor and a
last ``PublishStep``. Each tensor step has two parts the driver can place
apart: ``materialize`` touches the engine's arrays (run it inside the engine's
execution lease) and ``write`` touches only bytes (hash and positional write,
fine on a worker thread). Closing the generator at any point removes the temp
file, closes the fd and drops every array reference.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, cast

import numpy as np
import xxhash

from . import directio, errors, fileio, mlxthreads
from . import format as fmt
from .bytecopy import copy_into
from .codecs import CodecProvider, default_provider
from .fileio import DEFAULT_OPS, Durability, FileOps, temp_path_for
from .lease import Begun, NoLease, RunStep, off_loop, within
from .validate import validate_header

# mlx is imported inside the functions that touch the engine's arrays: the daemon writes the same steps from
# plain bytes (``BytesSource``) and never loads mlx.
if TYPE_CHECKING:
    import mlx.core as mx

    from .codecs.base import LiveSource, Source
    from .codecs.live import LiveCapture


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
    from .codecs.base import LiveSource

    return isinstance(src, LiveSource)


@dataclass
class Attachment:
    """Companion state saved beside the caches (e.g. a draft model's KV); never trimmed."""

    schema: str
    metadata: dict[str, str | int | float | bool] = field(default_factory=dict)
    tensors: list[mx.array] = field(default_factory=list)


@dataclass
class SaveResult:
    path: str
    header: fmt.Header
    file_bytes: int


def token_list(tokens: Any) -> list[int]:
    """Token ids from a list, numpy array or mlx array, checked to fit in u32 (vectorized: it runs on the engine thread)."""
    if tokens is None:
        return []
    import mlx.core as mx

    arr = np.asarray(tokens.tolist() if isinstance(tokens, mx.array) else tokens)
    if arr.size == 0:
        return []
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError("token ids must be a flat sequence of integers")
    if int(arr.min()) < 0 or int(arr.max()) >= 2**32:
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    if arr.size > fmt.MAX_TOKENS:
        raise errors.TooManyTokens(f"{arr.size} tokens (limit {fmt.MAX_TOKENS})")
    out: list[int] = arr.tolist()
    return out


def token_ids_now(tokens: Any) -> Sequence[int]:
    """Token ids as they are now, read on the caller's thread: an mlx array is evaluated and copied here (only
    this thread can evaluate its graph), a numpy array or a list copied. A plain copy (a memcpy for arrays):
    ``token_list`` makes the list of ints and checks it later, off the engine's thread."""
    import mlx.core as mx

    if isinstance(tokens, (mx.array, np.ndarray)):
        return cast(Sequence[int], np.array(tokens).reshape(-1) if tokens.ndim == 0 else np.array(tokens))
    return [] if tokens is None else list(tokens)


def clone_caches(caches: Sequence[Any], provider: CodecProvider | None = None) -> list[Any]:
    """Zero-copy clones (views) of live caches, for handing off in microseconds.

    Call it on the engine's thread: the views are evaluated there (no copy), so
    any thread can write them later. Free for a cache the engine drops; for a
    cache it keeps extending, the held views make its next in-place update copy
    the buffer once.
    """
    return clone_and_size(caches, provider)[0]


def clone_and_size(caches: Sequence[Any], provider: CodecProvider | None = None) -> tuple[list[Any], int]:
    """``clone_caches`` plus the bytes the clones pin (each distinct buffer once)."""
    import mlx.core as mx

    p = provider or default_provider()
    clones = [p.clone(c) for c in caches]
    arrays = {id(a): a for a in _held_arrays(clones)}
    mx.eval(list(arrays.values()))
    return clones, sum(a.nbytes for a in arrays.values())


def clone_attachments(attachments: Sequence[Attachment]) -> list[Attachment]:
    """Attachments as they are now: evaluated views, taken on the caller's (engine's) thread.

    A view is a new array node, so an engine that later updates a tensor in
    place (which rebinds the very object it handed over) does not change what
    is saved; the update copies the buffer instead.
    """
    import mlx.core as mx

    from .codecs.base import view

    out = [Attachment(a.schema, dict(a.metadata), [view(t) for t in a.tensors]) for a in attachments]
    mx.eval([t for a in out for t in a.tensors])
    return out


def evaluated(caches: Sequence[Any]) -> list[Any]:
    """The caches themselves, their pending work evaluated here (a no-op for evaluated caches)."""
    import mlx.core as mx

    mx.eval(_held_arrays(list(caches)))
    return list(caches)


def _held_arrays(obj: Any, depth: int = 0) -> list[mx.array]:
    """Every mlx array a cache object holds (attributes, lists, tuples, nested caches)."""
    import mlx.core as mx

    if isinstance(obj, mx.array):
        return [obj]
    if depth > fmt.MAX_NESTING + 2:
        return []
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in _held_arrays(x, depth + 1)]
    if hasattr(obj, "__dict__"):
        return [a for x in vars(obj).values() for a in _held_arrays(x, depth + 1)]
    return []


def _arrays(sources: Sequence[AnySource]) -> list[mx.array]:
    from .codecs.base import Source

    return [s.array for s in sources if isinstance(s, Source)]


class Staging:
    """A reused host buffer for rows copied out of a live cache (fresh pages are slow to fault in)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def take(self, n: int) -> memoryview:
        if self._buf.nbytes < n:
            self._buf = np.empty(max(n, 2 * self._buf.nbytes), dtype=np.uint8)
        return memoryview(self._buf.data)[:n]


class _File:
    """The temp file being written: opened on the first write, removed unless published."""

    def __init__(
        self, path: str, size: int, durability: Durability, ops: FileOps, direct: bool, sync_folder: bool = True
    ) -> None:
        self.path = path
        self.sync_folder = sync_folder  # False: the caller syncs the folder once for several files
        self.temp = temp_path_for(path)
        self.size = size
        self.durability = durability
        self.ops = ops
        self.fd: int | None = None
        self.renamed = False  # the final name exists
        self.published = False  # ... and is durable: the save succeeded
        self.want_direct = direct and bool(directio.O_DIRECT)
        self.direct: directio.DirectWriter | None = None

    def ensure_open(self) -> int:
        if self.fd is None:
            if self.want_direct:
                try:
                    self.fd = self.ops.open_new(self.temp, directio.O_DIRECT)
                    self.direct = directio.DirectWriter(self.fd, self.temp, self.ops)
                except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered writes
                    self.want_direct = False
                    self.fd = None
                    fileio.remove_quietly(self.ops, self.temp)  # some kernels create the file before refusing
            if self.fd is None:
                with fileio.io_errors("create", self.temp):
                    self.fd = self.ops.open_new(self.temp)
            fileio.preallocate(self.ops, self.fd, self.size, self.temp)
        return self.fd

    def write(self, bufs: Sequence[memoryview], offset: int) -> None:
        fd = self.ensure_open()
        if self.direct is not None:
            self.direct.write(bufs, offset)
        else:
            fileio.write_all(self.ops, fd, bufs, offset, self.temp)

    def publish(self, head: bytes) -> None:
        fd = self.ensure_open()
        if self.direct is not None:
            self.direct.write([memoryview(head)], 0)
            self.direct.flush()
            self.direct.close()
            with fileio.io_errors("truncate", self.temp):
                self.ops.ftruncate(fd, self.size)  # the last block's padding may run past the end
        else:
            fileio.write_all(self.ops, fd, [memoryview(head)], 0, self.temp)
        fileio.sync(self.ops, fd, self.durability, self.temp)
        self.fd = None
        with fileio.io_errors("close", self.temp):
            self.ops.close(fd)
        with fileio.io_errors("rename", self.path):
            self.ops.rename(self.temp, self.path)
        self.renamed = True
        if self.sync_folder:
            fileio.sync_dir(self.ops, os.path.dirname(self.path), self.durability)
        self.published = True

    def abort(self) -> None:
        if self.direct is not None:
            self.direct.close()  # no write may land on a closed (or reused) fd
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                self.ops.close(fd)
            except OSError:
                pass  # a failed fd is never fsynced or reused
        if not self.published:  # a save that fails after its rename (the folder's fsync) takes its name back
            fileio.remove_quietly(self.ops, self.path if self.renamed else self.temp)


def _byte_runs(src: Source) -> tuple[list[memoryview], mx.array]:
    """Zero-copy byte runs of the rows to store, in C order, plus the array they borrow."""
    import mlx.core as mx

    from . import dtypes

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
    """``_byte_runs`` of an engine buffer read from another thread; ``_NotEvaluated`` if it is still lazy.

    Reading a lazy array evaluates it, which fails off the thread that built it
    and leaves the graph as it was: the next hold, after the engine's next
    step, finds it evaluated.
    """
    from .codecs.base import Source

    try:
        return _byte_runs(Source(a, n, start))
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
            self.runs, self._held = _byte_runs(cast("Source", src))
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

    async def take_in_lease(self, lease: RunStep, chunk: int = LIVE_CHUNK_BYTES) -> None:
        """Take every byte through ``lease``, ``chunk`` bytes per hold, letting the engine run between holds."""
        while not await lease(functools.partial(self.take, chunk)):
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


class TensorStep:
    """Write one tensor. ``materialize`` inside the lease, then ``write`` anywhere."""

    def __init__(
        self, index: int, slot: fmt.Slot, source: AnySource, file: _File, data_start: int, staging: Staging | None
    ) -> None:
        self.index = index
        self.slot = slot
        self.nbytes = slot.nbytes
        self.bytes = TensorBytes(index, slot, source, staging)
        self._file = file
        self._data_start = data_start
        self.done = False

    @property
    def materialized(self) -> bool:
        return self.bytes.ready

    def materialize(self) -> None:
        """Take the source's bytes (the only part that touches the engine's arrays)."""
        while not self.materialize_part(None):
            pass

    def materialize_part(self, limit: int | None) -> bool:
        """At most ``limit`` bytes of engine-touching work; True once the tensor can be written."""
        return self.bytes.take(limit)

    async def take_in_lease(self, lease: RunStep, chunk: int = LIVE_CHUNK_BYTES) -> None:
        """``materialize`` through ``lease``, ``chunk`` bytes per hold, letting the engine run between holds."""
        while not await lease(functools.partial(self.materialize_part, chunk)):
            await asyncio.sleep(LIVE_RETRY_S if self.bytes.stalled_since is not None else 0)

    def write(self) -> None:
        """Hash and write the bytes at their planned offset; touches no mlx state."""
        if not self.bytes.ready or self.bytes.released:
            raise errors.SaveAborted(f"tensor {self.index} written before it was materialized")
        try:
            self.slot.hash = self.bytes.digest()
            self._file.write(self.bytes.runs, self._data_start + self.slot.off)
        finally:
            self.bytes.release()
        self.done = True

    def release(self) -> None:
        self.bytes.release()


class PublishStep:
    """Write the header with the real hashes, fsync, rename, fsync the folder."""

    nbytes = 0

    def __init__(self, header: fmt.Header, planned_len: int, file: _File) -> None:
        self.index = -1
        self._header = header
        self._planned_len = planned_len
        self._file = file
        self.done = False

    def materialize(self) -> None:
        """Nothing of the engine's is touched here."""

    def write(self) -> None:
        hb = fmt.pack_header(self._header)
        if len(hb) != self._planned_len:
            raise errors.PlanDrift(f"header length drift: planned {self._planned_len}, got {len(hb)}")
        head, _ = fmt.encode_prefix(hb, self._header.version, self._header.align)
        self._file.publish(head)
        self.done = True


SaveStep = TensorStep | PublishStep


_RELEASED = BytesSource([], (0,))  # what a step's slot holds once the step owns its source


@dataclass
class Encoded:
    """What ``encode_now`` read at the snapshot point: the caches' entries and the sources to write.

    A live snapshot's entries are planned later, by whoever calls ``resolved`` (the writer): at the call the
    engine's thread only records each cache's offset and evaluates its buffers (``LiveCapture``).
    """

    provider: CodecProvider
    entries: list[fmt.CacheEntry]
    attachments: list[fmt.AttachmentEntry]
    sources: list[AnySource]
    capture: LiveCapture | None = None

    def resolved(self) -> Encoded:
        """This, with a live capture's entries planned (cache sources first, then the attachments')."""
        if self.capture is None:
            return self
        parts = self.capture.encode()
        srcs: list[AnySource] = [a for p in parts for a in p.sources]
        return Encoded(self.provider, [p.entry for p in parts], self.attachments, srcs + self.sources)


def encode_now(
    caches: Sequence[Any],
    *,
    attachments: Sequence[Attachment] = (),
    provider: CodecProvider | None = None,
    live: bool = False,
) -> Encoded:
    """The part of a plan that reads the caches: run it on the engine's thread at the snapshot point.

    With ``live`` the caches are ones the engine keeps extending; append-only buffers are then read inside the
    lease at write time (see ``LiveSource``). The rest of the plan (``finish_plan``) touches only what this
    returns, so it may run later, on another thread.
    """
    import mlx.core as mx

    from .codecs.base import rows, slot_for

    p = provider or default_provider()
    capture = None
    sources: list[AnySource] = []
    entries = []
    if live:
        from .codecs.live import LiveCapture

        capture = LiveCapture(p, caches)
    else:
        encoded = [p.encode(c) for c in caches]
        entries = [e.entry for e in encoded]
        sources = [a for e in encoded for a in e.sources]
    att_entries = []
    for a in attachments:
        srcs = [rows(t) for t in a.tensors]
        att_entries.append(fmt.AttachmentEntry(a.schema, dict(a.metadata), [slot_for(s) for s in srcs]))
        sources.extend(srcs)
    # The engine's pending work, if any, runs here on the caller's thread (a no-op for
    # evaluated caches and clones): no other thread can evaluate it, and the steps then
    # only read finished buffers. One call for all of them.
    mx.eval(_arrays(sources), capture.arrays if capture else [])
    return Encoded(p, entries, att_entries, sources, capture)


def finish_plan(
    enc: Encoded,
    tokens: Any,
    *,
    meta: dict[str, str] | None = None,
    identity: fmt.Identity | None = None,
    checkpoint: fmt.GenerationCheckpoint | None = None,
) -> tuple[fmt.Header, list[AnySource]]:
    """Build the header (placeholder hashes, final offsets) from what ``encode_now`` read; pure bookkeeping."""
    enc = enc.resolved()
    header = fmt.Header(
        version=fmt.FORMAT_VERSION,
        created_at_ms=time.time_ns() // 1_000_000,
        codec_provider=enc.provider.id,
        identity=identity or fmt.Identity(),
        tokens=token_list(tokens),
        caches=enc.entries,
        attachments=enc.attachments,
        checkpoint=checkpoint,
        meta={str(k): str(v) for k, v in (meta or {}).items()},
    )
    if checkpoint is not None and checkpoint.original_prompt_tokens + checkpoint.generated_tokens != len(header.tokens):
        raise errors.CheckpointInconsistent("checkpoint prompt + generated tokens must equal the saved tokens")
    # Never publish a file our own reader would refuse: the readers' own validator, before any byte.
    validate_header(header)
    fmt.plan_layout(header)
    return header, enc.sources


def plan(
    tokens: Any,
    caches: Sequence[Any],
    *,
    meta: dict[str, str] | None = None,
    identity: fmt.Identity | None = None,
    attachments: Sequence[Attachment] = (),
    checkpoint: fmt.GenerationCheckpoint | None = None,
    provider: CodecProvider | None = None,
    live: bool = False,
) -> tuple[fmt.Header, list[AnySource]]:
    """Build the header (placeholder hashes, final offsets) and the list of sources: ``encode_now`` then
    ``finish_plan``. With ``live``, call it on the engine's thread at the snapshot point."""
    enc = encode_now(caches, attachments=attachments, provider=provider, live=live)
    return finish_plan(enc, tokens, meta=meta, identity=identity, checkpoint=checkpoint)


def save_steps(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    meta: dict[str, str] | None = None,
    *,
    identity: fmt.Identity | None = None,
    attachments: Sequence[Attachment] = (),
    checkpoint: fmt.GenerationCheckpoint | None = None,
    durability: Durability | str = Durability.FSYNC,
    provider: CodecProvider | None = None,
    ops: FileOps = DEFAULT_OPS,
    planned: tuple[fmt.Header, list[AnySource]] | None = None,
    staging: Staging | None = None,
    direct: bool | None = None,
    sync_folder: bool = True,
) -> Generator[SaveStep, None, SaveResult]:
    """Yield N tensor steps and one publish step; return the ``SaveResult``.

    The driver must run ``materialize()`` then ``write()`` on each step before
    asking for the next one. ``planned`` is a ``plan(...)`` made earlier (then
    ``tokens``, ``caches`` and the header arguments are ignored). ``direct``
    writes with O_DIRECT through aligned buffers (default: for files of 8 MiB
    or more, where the filesystem supports it). ``sync_folder=False`` leaves the
    folder's sync (what makes the new name durable) to the caller, who syncs it
    once for several files (a manifest's blocks).
    """
    dest = os.fspath(path)
    header, sources = planned or plan(
        tokens, caches, meta=meta, identity=identity, attachments=attachments, checkpoint=checkpoint, provider=provider
    )
    sources = list(sources)
    head_bytes = fmt.pack_header(header)
    header_len = len(head_bytes)
    _, data_start = fmt.encode_prefix(head_bytes, header.version, header.align)
    slots = header.slots()
    # the layout rule itself: a trailing empty tensor does not extend the file
    data_end = fmt.plan_offsets(slots, header.align)
    if direct is None:
        direct = data_end >= directio.DIRECT_MIN_BYTES
    direct = direct and header.align % directio.BLOCK == 0  # a packed file's tensors are not block-aligned
    file = _File(dest, data_start + data_end, Durability(durability), ops, direct, sync_folder)
    step: SaveStep | None = None
    try:
        for i, slot in enumerate(slots):
            step = TensorStep(i, slot, sources[i], file, data_start, staging)
            sources[i] = _RELEASED  # the step owns it now
            yield step
            if not step.done:
                raise errors.SaveAborted(f"tensor step {i} was not run to completion", path=dest)
        step = PublishStep(header, header_len, file)
        yield step
        if not step.done:
            raise errors.SaveAborted("publish step was not run", path=dest)
        header.header_len, header.data_start, header.file_size = header_len, data_start, data_start + data_end
        return SaveResult(dest, header, data_start + data_end)
    finally:
        if isinstance(step, TensorStep):
            step.release()
        sources.clear()
        file.abort()


def _marking(begun: Begun, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, which marks ``begun`` as it starts: a write's deadline counts from there."""

    @functools.wraps(fn)
    def run() -> None:
        begun.mark()
        fn()

    return run


# Steps that need nothing of an engine's (received bytes, the publish) run on one thread in batches of about this
# many bytes when the caller allows it (``save_async(batch_bytes=...)``): a loop turn and a thread hop per
# 100 KiB tensor cost more than its write.
WRITE_BATCH_BYTES = 8 * 1024 * 1024


def _engine_free(step: SaveStep) -> bool:
    return isinstance(step, PublishStep) or step.bytes.engine_free


class _Batch:
    """Run ``first`` (None: the generator's next step, its plan made on this thread) and the engine-free steps
    after it on the calling thread, up to ``limit`` bytes; then ``next`` is the step to run next (None when the
    save ended: ``result``). ``begun`` is marked at each step's start, so a deadline bounds each step, not the
    batch."""

    def __init__(
        self, gen: Generator[SaveStep, None, SaveResult], first: SaveStep | None, limit: int, begun: Begun
    ) -> None:
        self._gen, self._limit, self._begun = gen, limit, begun
        self.next: SaveStep | None = first
        self.result: SaveResult | None = None
        self.stopped = False  # set by the driver past a deadline: no step begins after the late one returns

    def _advance(self) -> bool:
        try:
            self.next = next(self._gen)
            return True
        except StopIteration as stop:  # caught here: a StopIteration cannot cross a future
            self.next, self.result = None, cast(SaveResult, stop.value)
            return False

    def run(self) -> None:
        done = 0
        if self.next is None:
            self._begun.mark()
            if not self._advance():
                return
        while (step := self.next) is not None and not self.stopped:
            self._begun.mark()
            step.materialize()
            step.write()
            done += step.nbytes
            if not self._advance() or (nxt := self.next) is None or not _engine_free(nxt):
                return
            if done >= self._limit and not isinstance(nxt, PublishStep):  # a file's publish goes with its last bytes
                return


async def take_all(sources: Sequence[AnySource], lease: RunStep) -> list[AnySource]:
    """Each array source's bytes taken as zero-copy runs (a ``BytesSource`` of them), one lease call per array: the
    engine-touching part of a save done up front, so that its writes can run in batches off the lease. A block put
    at B = 64 otherwise makes a step, a lease call and a thread hop of each block's every tensor (1,024 for 128 MiB,
    against 32 here). Live sources (rows the engine keeps extending) and plain bytes are left as they are."""
    from .codecs.base import Source

    out: list[AnySource] = []
    for s in sources:
        if isinstance(s, Source):
            runs, _ = await lease(functools.partial(_byte_runs, s))  # the views keep the array alive
            out.append(BytesSource(list(runs), tuple(s.shape)))
        else:
            out.append(s)
    return out


def _all_bytes(planned: tuple[fmt.Header, list[AnySource]] | None) -> bool:
    """A plan whose sources are all plain bytes: every step of its save is engine-free."""
    return planned is not None and all(isinstance(s, BytesSource) for s in planned[1])


def _close_later(loop: asyncio.AbstractEventLoop, gen: Generator[Any, None, Any]) -> None:
    """Close a save's generator (its file closed, its temp removed) on a worker thread: its late step returned."""
    loop.run_in_executor(None, mlxthreads.releasing(gen.close))


def run_step_sync(step: SaveStep) -> None:
    step.materialize()
    step.write()


def drive(gen: Generator[SaveStep, None, SaveResult], each: Callable[[SaveStep], None] = run_step_sync) -> SaveResult:
    """Run a step generator to the end on this thread."""
    try:
        while True:
            each(next(gen))
    except StopIteration as stop:
        return cast(SaveResult, stop.value)
    finally:
        gen.close()


def save(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    meta: dict[str, str] | None = None,
    **kwargs: Any,
) -> SaveResult:
    """Save caches to ``path`` now, atomically and (by default) durably."""
    return drive(save_steps(path, tokens, caches, meta, **kwargs))


async def save_async(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    meta: dict[str, str] | None = None,
    *,
    run_step: RunStep | None = None,
    write_in_lease: bool = False,
    live_chunk: int = LIVE_CHUNK_BYTES,
    step_deadline: float | None = None,
    batch_bytes: int = 0,
    **kwargs: Any,
) -> SaveResult:
    """Save one step per event-loop turn without blocking the loop.

    ``run_step(fn)`` is the caller's execution lease: it runs ``fn`` while the
    engine is between steps and returns its result. Each tensor's
    ``materialize`` runs through it; its hash and write run on a worker thread,
    inside the lease too when ``write_in_lease`` is set. A lease that raises
    aborts the save and leaves nothing behind. A write step that does not return within ``step_deadline``
    seconds fails the save (``StorageTimeout``) at once; its file is cleaned up once the step returns.
    ``batch_bytes`` > 0 runs steps that touch nothing of an engine's (bytes the daemon received, and the publish)
    in batches of about that many bytes per lease call: only for a lease that keeps no engine waiting.
    """
    lease: RunStep = run_step or NoLease()
    gen = save_steps(path, tokens, caches, meta, **kwargs)
    late = False
    loop = asyncio.get_running_loop()
    pending: SaveStep | None = None
    # all plain bytes: even the plan (packing the header) is made on the batch's thread, not on the loop
    free = batch_bytes > 0 and _all_bytes(kwargs.get("planned"))
    try:
        while True:
            begun = Begun()
            if free:
                batch: _Batch | None = _Batch(gen, pending, batch_bytes, begun)
            else:
                try:
                    step = pending or next(gen)
                except StopIteration as stop:
                    return cast(SaveResult, stop.value)
                batch = _Batch(gen, step, batch_bytes, begun) if batch_bytes > 0 and _engine_free(step) else None
            if batch is not None:
                fn = batch.run  # advances the generator on its thread
            else:
                if isinstance(step, TensorStep) and not step.bytes.engine_free:
                    await step.take_in_lease(lease, live_chunk)  # the engine gets its turn between two copies
                else:
                    step.materialize()  # bytes already ours (the daemon's): nothing of an engine's to keep out
                fn = _marking(begun, step.write)
            work = lease(fn) if write_in_lease else off_loop(fn, background=True)
            try:
                # the cleanup (closing the file, removing the temp) waits for the late step, off the loop
                await within(work, step_deadline, "a write step", lambda: _close_later(loop, gen), begun)
            except errors.StorageTimeout:
                late = True
                if batch is not None:
                    batch.stopped = True
                raise
            if batch is not None and batch.result is not None:
                return batch.result
            pending = batch.next if batch is not None else None
            await asyncio.sleep(0)  # one step (or one batch) per loop turn
    finally:
        if not late:
            gen.close()
