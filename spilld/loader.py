"""The verified loader: every length bounded by the file before allocating,
identity and codecs checked before any tensor is read, every tensor hash checked.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import xxhash

from . import assemble, buffers, errors, fileio, mlxthreads
from . import format as fmt
from .codecs import CodecProvider, default_provider
from .codecs.rules import cut_floor, growth_allowed
from .fileio import DEFAULT_OPS, FileOps
from .lru import LRU
from .saver import Attachment, evaluated
from .validate import header_from_bytes

# Reading headers (the daemon's index scan, ``spilld verify``) needs no mlx; building arrays imports it then.
if TYPE_CHECKING:
    import mlx.core as mx


def _read_exact(fd: int, n: int, off: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), off + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _read_header_fd(fd: int, path: str, expect: assemble.ExpectFn | None = None, size: int | None = None) -> fmt.Header:
    """The file's checked header: taken as ``expect`` says when it is exactly that, else validated."""
    with fileio.io_errors("read", path):  # an I/O error reading a header is a StorageError, as in a tensor read
        size = os.fstat(fd).st_size if size is None else size
        prefix = fmt.decode_prefix(_read_exact(fd, fmt.PREFIX_LEN, 0), size, path)  # bounds the read below
        raw = _read_exact(fd, prefix.data_start, 0)
    header = expect(prefix, raw, size) if expect is not None else None
    return header if header is not None else header_from_bytes(raw, size, path)


BLOCK_HEADERS_CACHED = 1024  # validated block headers kept per process (a block is immutable once published)
_block_headers: LRU[tuple[str, int, int, int, int], fmt.Header] = LRU(BLOCK_HEADERS_CACHED)


def _read_block_header(fd: int, path: str, expect: assemble.ExpectFn | None = None) -> fmt.Header:
    """``_read_header_fd`` for block files, remembered by (path, device, inode, size, mtime): the blocks a restore
    reads are mostly ones read before (a shared prefix, the previous turn's). Only a header this process validated
    (or found to be exactly what ``expect`` says) is remembered, and every tensor is still checked against its
    hash on each read."""
    st = os.fstat(fd)
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if (got := _block_headers.get(key)) is not None:
        return got
    header = _read_header_fd(fd, path, expect, st.st_size)
    _block_headers.put(key, header)
    return header


def _block_header_at(path: str, ops: FileOps, expect: assemble.ExpectFn | None = None) -> fmt.Header:
    """A block's validated header; its file is open only while it is read (a load holds no fd per block)."""
    fd = _open(ops, path)
    try:
        return _read_block_header(fd, path, expect)
    finally:
        ops.close(fd)


def _open(ops: FileOps, path: str) -> int:
    with fileio.io_errors("open", path):
        return ops.open_read(path)


def read_header(path: str | os.PathLike[str], ops: FileOps = DEFAULT_OPS) -> fmt.Header:
    """Read and check a file's prefix and header: magic, version, lengths, hash, layout."""
    p = os.fspath(path)
    fd = _open(ops, p)
    try:
        return _read_header_fd(fd, p)
    finally:
        ops.close(fd)


def read_own_header(path: str) -> fmt.Header:
    """``read_header`` of a file in a store's own folders, which spilld only ever fills with regular files: a
    symbolic link there is someone else's, refused (a StorageError, ELOOP) rather than followed."""
    with fileio.io_errors("open", path):
        fd = fileio.open_regular(path, os.O_NOFOLLOW)
    try:
        return _read_header_fd(fd, path)
    finally:
        os.close(fd)


VERIFY_CHUNK = 8 * 1024 * 1024
LOAD_THREADS = min(8, max(2, os.cpu_count() or 2))  # files or tensors read and hashed at once (both free the GIL)
# A manifest's block files at most this many at once: their 16 KiB pieces keep Python busy under the GIL, and
# more threads only wait for it (16 cores, 1 GiB at B = 64, read phase: 155 ms on 2 or 3 threads, 270 on 8).
BLOCK_LOAD_THREADS = 3
PARALLEL_MIN_BYTES = 8 * 1024 * 1024
READ_CHUNK = 1024 * 1024  # bytes read per call and hashed at once, while they are still in the CPU's cache


def verify_file(
    path: str | os.PathLike[str], ops: FileOps = DEFAULT_OPS, blocks: assemble.BlockPaths | None = None
) -> fmt.Header:
    """Check a whole file without building caches: header, layout and every tensor hash; for a v2 manifest,
    every block it names as well (found through ``blocks``, default: its own folder)."""
    p = os.fspath(path)
    header = _verify_one(p, ops)
    if header.blocks is not None:
        resolve = blocks or assemble.beside(p)
        assemble.checked_blocks(header, p, resolve, lambda b, _: _verify_one(b, ops), len(header.blocks.keys))
    return header


def _verify_one(p: str, ops: FileOps) -> fmt.Header:
    steps = verify_steps(p, ops)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(fmt.Header, done.value)


def verify_steps(path: str, ops: FileOps = DEFAULT_OPS) -> Generator[int, None, fmt.Header]:
    """``verify_file`` of one file, a chunk of at most ``VERIFY_CHUNK`` bytes a step (each yields its bytes; the
    file's header is the result): a background check can pace itself and yield to serving between two steps. The
    file is open until the last step, or the generator's close."""
    fd = _open(ops, path)
    try:
        header = _read_header_fd(fd, path)
        buf = bytearray(VERIFY_CHUNK)
        for i, slot in enumerate(header.slots()):
            h = xxhash.xxh3_64()
            done = 0
            while done < slot.nbytes:
                n = min(VERIFY_CHUNK, slot.nbytes - done)
                view = memoryview(buf)[:n]
                fileio.read_all(ops, fd, [view], header.data_start + slot.off + done, path)
                h.update(view)
                done += n
                yield n
            if h.digest() != slot.hash:
                raise errors.TensorHashMismatch(f"tensor {i} at offset {slot.off} does not match its hash", path=path)
        return header
    finally:
        ops.close(fd)


@dataclass
class Loaded:
    """What ``load`` returns: the caches ready for the engine and everything saved beside them."""

    tokens: list[int]
    caches: list[Any]
    header: fmt.Header
    attachments: list[Attachment] = field(default_factory=list)
    checkpoint: fmt.GenerationCheckpoint | None = None
    meta: dict[str, str] = field(default_factory=dict)


def check_identity(header: fmt.Header, expect: fmt.Identity | Mapping[str, str] | None, path: str) -> None:
    """Every field ``expect`` sets must equal the file's."""
    if expect is None:
        return
    want = expect.to_wire() if isinstance(expect, fmt.Identity) else dict(expect)
    have = header.identity.to_wire()
    for key, value in want.items():
        if key not in have:
            raise ValueError(f"unknown identity field {key!r}")
        if value and have[key] != value:
            raise errors.IdentityMismatch(f"{key} mismatch (file {have[key]!r}, expected {value!r})", path=path)


def alloc_shape(slot: fmt.Slot, capacity: int | None, path: str) -> list[int]:
    """The shape to allocate for a slot: its own, or grown along axis -2 to ``capacity`` rows.

    A load never allocates more than a tensor's bytes plus one capacity step of the rows it holds,
    within ``GROWTH_MAX_BYTES`` or the tensor's own bytes (``rules.growth_allowed``): codecs ask a
    capacity only where every tensor of their cache may take it (``codecs.base.grown``), and this
    is the guard if one did not (``CapacityTooLarge``, never a buffer grown for one tensor of a
    cache and not another).
    """
    shape = list(slot.shape)
    if capacity is None or len(shape) < 2 or capacity <= shape[-2]:
        return shape
    if not growth_allowed(slot, capacity):
        raise errors.CapacityTooLarge(f"{capacity} rows asked for a tensor of {shape[-2]} rows", path=path)
    shape[-2] = capacity
    return shape


class _Decoding:
    """What the codecs call back into: ``read`` (per subclass) and ``decode`` for nested entries."""

    provider: CodecProvider
    path: str

    def read(self, slot: fmt.Slot, capacity: int | None = None) -> mx.array:
        raise NotImplementedError

    def decode(self, entry: fmt.CacheEntry) -> Any:
        return self.provider.for_entry(entry, self.path).decode(entry, self)


class _Reader(_Decoding):
    """Reads tensors straight into freshly allocated mlx buffers, verifying hashes.

    A v2 manifest's positional tensors are read piece by piece (its blocks', then its own rows): ``pieces``.
    """

    def __init__(
        self,
        fd: int,
        header: fmt.Header,
        provider: CodecProvider,
        verify: bool,
        ops: FileOps,
        path: str,
        pieces: dict[int, list[assemble.Piece]] | None = None,
    ):
        self.fd, self.header, self.provider = fd, header, provider
        self.verify, self.ops, self.path = verify, ops, path
        self.pieces = pieces or {}

    def read(self, slot: fmt.Slot, capacity: int | None = None) -> mx.array:
        buf = self.alloc(slot, capacity)
        self.fill(buf)
        return buf.arr

    def fill(self, buf: _Buffer) -> None:
        """Prepare ``buf`` and read every piece of it, file by file."""
        buf.prepare()
        for file_reads in _by_file([buf]).values():
            self.read_file(file_reads)

    def alloc(self, slot: fmt.Slot, capacity: int | None) -> _Buffer:
        """A new buffer for ``slot`` (grown to ``capacity`` rows) and, for each of its pieces, where in the
        buffer its bytes go (rows ``[first, first + rows)`` of every leading index). Its pages are neither
        touched nor zeroed yet: ``_Buffer.prepare`` does that, on whichever thread will read into it."""
        import mlx.core as mx

        from . import dtypes

        pieces = self.pieces.get(id(slot)) or [self.whole_piece(slot)]
        alloc = alloc_shape(slot, capacity, self.path)
        arr = buffers.unfilled(alloc, slot.dtype)
        unfilled = arr is not None
        if arr is None:
            arr = mx.zeros(alloc, dtype=dtypes.dtype_of(slot.dtype))
            mx.eval(arr)
        if arr.nbytes == 0:
            return _Buffer(arr, memoryview(b""), [], False, False, 0, 0, 0)
        if len(alloc) >= 2:
            lead, rows = math.prod(alloc[:-2]), alloc[-2]
        else:
            lead, rows = 1, 1
        mv = dtypes.buffer(arr).cast("B")
        rb = mv.nbytes // (lead * rows)
        # only a piece alone can fill the whole buffer (a tensor of one file)
        whole = len(alloc) < 2 or (len(pieces) == 1 and list(pieces[0].slot.shape) == alloc)
        dest, first = _Dest(mv, lead, rows * rb, rb, rows, whole), 0
        for p in pieces:
            p.into, p.first = dest, first
            first += p.rows
        filled = rows if whole else first
        populate = unfilled and not buffers.advise_huge(buffers.address(mv), mv.nbytes) and bool(self.pieces)
        return _Buffer(arr, mv, pieces, unfilled, populate, lead, rows, filled)

    def whole_piece(self, slot: fmt.Slot) -> assemble.Piece:
        rows = slot.shape[-2] if len(slot.shape) >= 2 else 0
        return assemble.Piece(self.fd, self.path, self.header.data_start + slot.off, rows, slot)

    def read_file(self, reads: list[assemble.Piece]) -> None:
        """Pieces of one file, in file order, each run of adjacent pieces from one offset onward."""
        reads = sorted(reads, key=lambda p: p.off)
        first = reads[0]
        fd = first.fd if first.fd is not None else _open(self.ops, first.path)
        try:
            i = 0
            while i < len(reads):
                j, end = i + 1, reads[i].off + reads[i].slot.nbytes
                while j < len(reads) and reads[j].off == end:
                    end += reads[j].slot.nbytes
                    j += 1
                _Batch(self, fd, reads[i]).read(reads[i:j])
                i = j
        finally:
            if first.fd is None:
                self.ops.close(fd)


@dataclass(slots=True)
class _Dest:
    """A tensor's buffer ``mv`` as its pieces fill it: ``lead`` leading indices of ``rows`` rows, each index
    ``stride`` bytes long (``row`` bytes a row). A piece fills rows ``[piece.first, piece.first + piece.rows)``
    of each index, or every row when it is ``whole`` (the buffer's one piece, of the buffer's own shape)."""

    mv: memoryview
    lead: int
    stride: int
    row: int
    rows: int
    whole: bool

    def rows_of(self, p: assemble.Piece) -> tuple[int, int]:
        """The first row ``p`` fills, and how many."""
        return (0, self.rows) if self.whole else (p.first, p.rows)


@dataclass
class _Buffer:
    """A tensor's new buffer ``arr`` (its bytes ``mv``), where its pieces go (``reads``), and, for one allocated
    without a zero fill (``unfilled``), whether to fault its pages in first (``populate``) and its ``lead`` x
    ``rows`` rows of which the first ``filled`` are read into."""

    arr: mx.array
    mv: memoryview
    reads: list[assemble.Piece]  # each with its ``into`` set to this buffer's ``_Dest``
    unfilled: bool
    populate: bool
    lead: int
    rows: int
    filled: int

    def prepare(self) -> None:
        """Fault in the buffer's pages where asked (``buffers.populate``) and zero the rows of an unfilled one
        that no piece fills (step capacity), as in a fresh cache. A loader thread's work: the allocation itself
        stays on one thread (``_read_all``)."""
        if not self.unfilled:
            return
        import numpy as np

        if self.populate:
            buffers.populate(buffers.address(self.mv), self.mv.nbytes)
        if self.filled < self.rows:
            np.frombuffer(self.mv, dtype=np.uint8).reshape(self.lead, self.rows, -1)[:, self.filled :, :] = 0


class _Batch:
    """Reads adjacent pieces of one file in calls of up to ``READ_CHUNK`` bytes (each piece's rows of each leading
    index straight into its buffer), hashing each call's bytes at once, while they are still in the CPU's cache,
    and checking each piece once its last byte is read."""

    def __init__(self, reader: _Reader, fd: int, first: assemble.Piece) -> None:
        self.reader, self.fd, self.path, self.off = reader, fd, first.path, first.off
        self.views: list[memoryview] = []  # read by the next call, in file order
        self.hashed: list[tuple[Any, list[memoryview]]] = []  # (hasher, its bytes) to hash after it
        self.done: list[tuple[assemble.Piece, Any]] = []  # pieces whose last bytes it reads
        self.size = 0

    def read(self, reads: list[assemble.Piece]) -> None:
        verify = self.reader.verify
        for p in reads:
            d: _Dest = p.into
            h = xxhash.xxh3_64() if verify else None
            first, rows = d.rows_of(p)
            run = rows * d.row
            if d.lead * run != p.slot.nbytes:
                raise errors.BlockInvalid(f"tensor at offset {p.slot.off} has another size than planned", path=p.path)
            start = first * d.row
            if d.lead == 1 or run == d.stride:  # contiguous in the buffer
                self.add(d.mv[start : start + p.slot.nbytes], h)
            # a block's rows: one short run per leading index, one call; never empty ones (an empty tail: found in
            # review, 1,024 of them first in a call read nothing, taken for the file's end; ``add`` takes none)
            elif run and p.slot.nbytes <= READ_CHUNK:
                if self.size + p.slot.nbytes > READ_CHUNK:
                    self.flush()
                views = [d.mv[o : o + run] for o in range(start, start + d.lead * d.stride, d.stride)]
                self.views += views
                if h is not None:
                    self.hashed.append((h, views))
                self.size += p.slot.nbytes
            else:
                for o in range(start, start + d.lead * d.stride, d.stride):
                    self.add(d.mv[o : o + run], h)
            if h is not None:
                self.done.append((p, h))
        self.flush()

    def add(self, view: memoryview, h: Any) -> None:
        pos = 0
        while pos < view.nbytes:
            n = min(READ_CHUNK - self.size, view.nbytes - pos)
            v = view[pos : pos + n] if n != view.nbytes else view
            self.views.append(v)
            if h is not None:
                self.hashed.append((h, [v]))
            self.size += n
            pos += n
            if self.size >= READ_CHUNK:
                self.flush()

    def flush(self) -> None:
        if self.views:
            fileio.read_all(self.reader.ops, self.fd, self.views, self.off, self.path, self.size)
        self.off += self.size
        for h, views in self.hashed:
            for v in views:
                h.update(v)
        for p, h in self.done:
            if h.digest() != p.slot.hash:
                raise errors.TensorHashMismatch(f"tensor at offset {p.slot.off} does not match its hash", path=p.path)
        self.views, self.hashed, self.done = [], [], []
        self.size = 0


class _Recorder(_Decoding):
    """A dry run of the codecs: learns which tensors they read, and with what capacity, reading nothing."""

    def __init__(self, provider: CodecProvider, path: str) -> None:
        self.provider, self.path = provider, path
        self.wants: dict[int, tuple[fmt.Slot, int | None]] = {}

    def read(self, slot: fmt.Slot, capacity: int | None = None) -> mx.array:
        import mlx.core as mx

        from . import dtypes

        self.wants[id(slot)] = (slot, capacity)
        return mx.zeros(
            alloc_shape(slot, capacity, self.path), dtype=dtypes.dtype_of(slot.dtype)
        )  # lazy: never evaluated, never allocated


class _Prefetched(_Decoding):
    """Hands the codecs tensors that worker threads read ahead (allocation, read and hash on ``LOAD_THREADS`` threads)."""

    def __init__(self, reader: _Reader, arrays: dict[int, mx.array]) -> None:
        self.reader, self.arrays = reader, arrays
        self.provider, self.path = reader.provider, reader.path

    def read(self, slot: fmt.Slot, capacity: int | None = None) -> mx.array:
        return self.arrays.pop(id(slot)) if id(slot) in self.arrays else self.reader.read(slot, capacity)


class _Inline(concurrent.futures.Executor):
    """Runs each task at once on the calling thread: a small manifest's reads need no pool (starting its thread
    and handing it dozens of tasks cost a fresh process more than the reads). A task's error is raised by
    ``submit`` itself, never kept in a future: its traceback's frames lead back to the one holding that future, a
    cycle that kept every buffer of a failed load until the garbage collector ran (found in review)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


def _decode_parallel(reader: _Reader, entries: list[fmt.CacheEntry], threads: int) -> list[Any]:
    plan = _Recorder(reader.provider, reader.path)
    for e in entries:
        plan.decode(e)
    pool: concurrent.futures.Executor = mlxthreads.worker_pool(threads, "spilld-load") if threads > 1 else _Inline()
    with pool:
        arrays = _read_all(reader, plan.wants, pool)
    ctx = _Prefetched(reader, arrays)
    return [ctx.decode(e) for e in entries]


def _pool_size(threads: int, big: bool, blocks: bool) -> int:
    """Threads for a load: one for a small one, at most ``BLOCK_LOAD_THREADS`` for a manifest's blocks."""
    if not big:
        return 1
    return min(threads, BLOCK_LOAD_THREADS) if blocks else threads


def _read_all(
    reader: _Reader, wants: dict[int, tuple[fmt.Slot, int | None]], pool: concurrent.futures.Executor
) -> dict[int, mx.array]:
    """The tensors the codecs will ask for. Every buffer is allocated first, on this thread: mlx makes each on
    its stream's thread, which takes the GIL to call back into Python (the file object ``buffers.unfilled`` hands
    ``mx.load``), so allocations made from busy loader threads wait on one another. Then the pool fills them: a
    whole file's tensors one task each; a manifest's pages faulted in per buffer, then each of its files (a block,
    the manifest) read by one task straight into the buffers at their row offsets, adjacent pieces in reads of up
    to ``READ_CHUNK`` bytes."""
    bufs = {k: reader.alloc(slot, cap) for k, (slot, cap) in wants.items()}
    if not reader.pieces:
        _results({k: pool.submit(reader.fill, b) for k, b in bufs.items()})
        return {k: b.arr for k, b in bufs.items()}
    _results({k: pool.submit(b.prepare) for k, b in bufs.items()})
    _results({f: pool.submit(reader.read_file, reads) for f, reads in _by_file(bufs.values()).items()})
    return {k: b.arr for k, b in bufs.items()}


def _by_file(bufs: Iterable[_Buffer]) -> dict[str, list[assemble.Piece]]:
    """The buffers' pieces grouped by the file each is read from."""
    out: dict[str, list[assemble.Piece]] = {}
    for b in bufs:
        for p in b.reads:
            out.setdefault(p.path, []).append(p)
    return out


def _results(futs: dict[Any, concurrent.futures.Future[Any]]) -> dict[Any, Any]:
    """Every task's result; on a failure the others are cancelled, or waited for if running (they write into
    buffers the caller releases next). Then the futures are let go: the failed one holds the exception, whose
    traceback holds this frame and the caller's, and with them every buffer of the load, a cycle only the garbage
    collector would free (found in review: 12-50 MiB held after failed loads of an 8 MiB entry)."""
    out: dict[Any, Any] = {}
    try:
        for key, fut in futs.items():
            out[key] = fut.result()
        return out
    except BaseException:
        for fut in futs.values():
            fut.cancel()
        concurrent.futures.wait(futs.values())
        futs.clear()
        del fut
        raise


def _cut(caches: list[Any], header: fmt.Header, upto: int, path: str, prov: CodecProvider) -> None:
    """Cut loaded caches back to ``upto`` tokens (each by its codec), where the header says that is valid."""
    if upto > header.restorable_tokens or upto < 0:  # (past the least offset the caches hold nothing to cut to)
        raise errors.NotReusable(f"cannot cut to {upto} tokens: the caches hold {header.restorable_tokens}", path=path)
    # no cut: every offset is within the tokens recorded (the validator's rule), unless none are (a file saved
    # without tokens, whose caches then hold any number: found in review, one was given back whole for ``upto=0``)
    if upto == len(header.tokens) and (header.tokens or not header.caches):
        return
    if not header.trimmable:
        raise errors.NotReusable("entry is not trimmable (rotated ring, recurrent state or attachments)", path=path)
    if upto < (floor := cut_floor(header)):
        raise errors.NotReusable(f"cannot cut below the minimum reusable offset {floor}", path=path)
    for c, e in zip(caches, header.caches, strict=True):
        _cut_to(prov, c, e, upto, path)


def _cut_to(prov: CodecProvider, cache: Any, e: fmt.CacheEntry, upto: int, path: str) -> None:
    """One cache cut to ``upto`` tokens by its codec; a container's children each by their own (a CacheList's trim
    would call theirs: a ConcatenateKVCache inside one kept its rows, found in review)."""
    codec = prov.for_entry(e, path)
    if e.children:
        for child, ce in zip(codec.children(cache), e.children, strict=True):
            _cut_to(prov, child, ce, upto, path)
    elif e.offset is not None and e.offset > upto:
        codec.cut(cache, e.offset - upto)


def load(
    path: str | os.PathLike[str],
    *,
    expect: fmt.Identity | Mapping[str, str] | None = None,
    verify: bool = True,
    upto: int | None = None,
    provider: CodecProvider | None = None,
    ops: FileOps = DEFAULT_OPS,
    threads: int = LOAD_THREADS,
    blocks: assemble.BlockPaths | None = None,
    blocks_only: bool = False,
) -> Loaded:
    """Load a file into cache objects of the right classes.

    A v2 manifest's blocks are found through ``blocks`` (a store's index; default: its own folder) and
    checked against it before anything is allocated; ``blocks_only`` restores ``upto`` tokens from its
    blocks alone (valid when every cache is positional), leaving its own rows, attachments and checkpoint.

    Checks the codec provider, every entry's codec and ``expect`` before
    allocating. With ``upto`` the caches are cut back to that many tokens
    (refused with ``NotReusable`` when the header says it is not valid, or past
    the tokens the caches hold); without, the file's caches and tokens as saved.
    """
    p = os.fspath(path)
    prov = provider or default_provider()
    fd = _open(ops, p)
    try:
        header = _read_header_fd(fd, p)
        if header.block is not None:
            raise errors.BlockInvalid("a block is read through a manifest that names it, not alone", path=p)
        if header.codec_provider != prov.id:
            raise errors.CodecProviderMismatch(
                f"written by codec provider {header.codec_provider!r}, reader has {prov.id!r}", path=p
            )
        prov.check_entries(header.caches, p)
        check_identity(header, expect, p)
        whole, pieces = header, None
        if header.blocks is not None:
            plan = assemble.open_plan(
                header, fd, p, blocks or assemble.beside(p), lambda b, expect: _block_header_at(b, ops, expect),
                upto=upto, blocks_only=blocks_only,
            )  # fmt: skip
            whole, pieces = plan.header, plan.pieces
        reader = _Reader(fd, whole, prov, verify, ops, p, pieces)
        big = threads > 1 and whole.data_bytes >= PARALLEL_MIN_BYTES
        if big or pieces:  # a manifest's files are read one task each (a small one's on one thread: no GIL hand-offs)
            caches = _decode_parallel(reader, whole.caches, _pool_size(threads, big, bool(pieces)))
        else:
            caches = [reader.decode(e) for e in whole.caches]
        attachments = [
            Attachment(a.schema, dict(a.metadata), [reader.read(s) for s in a.tensors]) for a in whole.attachments
        ]
    finally:
        ops.close(fd)
    tokens = whole.tokens
    if upto is not None:
        _cut(caches, whole, upto, p, prov)
        tokens = tokens[:upto]
    # Every array evaluated here: a lazy one (a batch cache's offsets after a trim) is bound to this thread's streams,
    # and a load often runs on a worker thread whose streams end with it. The tensors read are evaluated already.
    return Loaded(tokens, evaluated(caches), header, attachments, whole.checkpoint, header.meta)
