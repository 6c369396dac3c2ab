"""The verified loader: every length bounded by the file before allocating,
identity and codecs checked before any tensor is read, every tensor hash checked.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from . import assemble, errors, fileio
from . import format as fmt
from .codecs import CodecProvider, default_provider
from .codecs.rules import CAPACITY_STEP
from .fileio import DEFAULT_OPS, FileOps
from .saver import Attachment
from .validate import validate_header

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


def _read_header_fd(fd: int, path: str) -> fmt.Header:
    size = os.fstat(fd).st_size
    prefix = fmt.decode_prefix(_read_exact(fd, fmt.PREFIX_LEN, 0), size, path)
    region = _read_exact(fd, prefix.data_start - fmt.PREFIX_LEN, fmt.PREFIX_LEN)
    if len(region) != prefix.data_start - fmt.PREFIX_LEN:
        raise errors.TruncatedFile("file ended inside the header", path=path)
    header_bytes, pad = region[: prefix.header_len], region[prefix.header_len :]
    header = fmt.decode_header(header_bytes, prefix, size, path)
    validate_header(header, size, prefix_version=prefix.version, path=path)
    fmt.check_padding(pad, path)
    return header


BLOCK_HEADERS_CACHED = 1024  # validated block headers kept per process (a block is immutable once published)
_block_headers: OrderedDict[tuple[str, int, int, int, int], fmt.Header] = OrderedDict()
_block_headers_lock = threading.Lock()


def _read_block_header(fd: int, path: str) -> fmt.Header:
    """``_read_header_fd`` for block files, remembered by (path, device, inode, size, mtime): the blocks a restore
    reads are mostly ones read before (a shared prefix, the previous turn's). Only a header this process validated
    is remembered, and every tensor is still checked against its hash on each read."""
    st = os.fstat(fd)
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _block_headers_lock:
        got = _block_headers.get(key)
        if got is not None:
            _block_headers.move_to_end(key)
            return got
    header = _read_header_fd(fd, path)
    with _block_headers_lock:
        _block_headers[key] = header
        while len(_block_headers) > BLOCK_HEADERS_CACHED:
            _block_headers.popitem(last=False)
    return header


def _block_header_at(path: str, ops: FileOps) -> fmt.Header:
    """A block's validated header; its file is open only while it is read (a load holds no fd per block)."""
    fd = _open(ops, path)
    try:
        return _read_block_header(fd, path)
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


VERIFY_CHUNK = 8 * 1024 * 1024
LOAD_THREADS = 2  # tensors allocated, read and hashed in parallel (each step releases the GIL)
PARALLEL_MIN_BYTES = 8 * 1024 * 1024


def verify_file(
    path: str | os.PathLike[str], ops: FileOps = DEFAULT_OPS, blocks: assemble.BlockPaths | None = None
) -> fmt.Header:
    """Check a whole file without building caches: header, layout and every tensor hash; for a v2 manifest,
    every block it names as well (found through ``blocks``, default: its own folder)."""
    p = os.fspath(path)
    header = _verify_one(p, ops)
    if header.blocks is not None:
        resolve = blocks or assemble.beside(p)
        assemble.checked_blocks(header, p, resolve, lambda b: _verify_one(b, ops), len(header.blocks.keys))
    return header


def _verify_one(p: str, ops: FileOps) -> fmt.Header:
    fd = _open(ops, p)
    try:
        header = _read_header_fd(fd, p)
        buf = bytearray(VERIFY_CHUNK)
        for i, slot in enumerate(header.slots()):
            h = xxhash.xxh3_64()
            done = 0
            while done < slot.nbytes:
                n = min(VERIFY_CHUNK, slot.nbytes - done)
                view = memoryview(buf)[:n]
                fileio.read_all(ops, fd, [view], header.data_start + slot.off + done, p)
                h.update(view)
                done += n
            if h.digest() != slot.hash:
                raise errors.TensorHashMismatch(f"tensor {i} at offset {slot.off} does not match its hash", path=p)
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

    A load never allocates more than a tensor's bytes plus one capacity step of the rows it
    holds: codecs compute capacity from stored rows, and this is the guard if one did not.
    """
    shape = list(slot.shape)
    if capacity is None or len(shape) < 2 or capacity <= shape[-2]:
        return shape
    if shape[-2] == 0 or capacity > shape[-2] + CAPACITY_STEP:
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
        arr, reads = self.alloc(slot, capacity)
        try:
            for p, runs in reads:
                self.read_piece(p, runs)
        finally:
            release(reads)
        return arr

    def alloc(
        self, slot: fmt.Slot, capacity: int | None
    ) -> tuple[mx.array, list[tuple[assemble.Piece, list[memoryview]]]]:
        """A new buffer for ``slot`` (grown to ``capacity`` rows) and, for each of its pieces, the views of the
        buffer its bytes go to (rows ``[first, first + rows)`` of every leading index)."""
        import mlx.core as mx

        from . import dtypes

        pieces = self.pieces.get(id(slot)) or [self.whole_piece(slot)]
        alloc = alloc_shape(slot, capacity, self.path)
        arr = mx.zeros(alloc, dtype=dtypes.dtype_of(slot.dtype))
        mx.eval(arr)
        if arr.nbytes == 0:
            return arr, []
        mv = dtypes.buffer(arr).cast("B")
        reads, first = [], 0
        for p in pieces:
            whole = len(alloc) < 2 or list(p.slot.shape) == alloc
            spans = fmt.row_spans(alloc, fmt.DTYPE_SIZES[slot.dtype], None if whole else p.rows, 0 if whole else first)
            reads.append((p, [mv[o : o + n] for o, n in spans]))
            first += p.rows
        mv.release()
        return arr, reads

    def whole_piece(self, slot: fmt.Slot) -> assemble.Piece:
        rows = slot.shape[-2] if len(slot.shape) >= 2 else 0
        return assemble.Piece(self.fd, self.path, self.header.data_start + slot.off, rows, slot)

    def read_piece(self, p: assemble.Piece, runs: list[memoryview]) -> None:
        """``p``'s bytes into ``runs`` (in file order), its hash checked."""
        self.read_file([(p, runs)])

    def check(self, p: assemble.Piece, runs: list[memoryview]) -> None:
        if self.verify:
            h = xxhash.xxh3_64()
            for r in runs:
                h.update(r)
            if h.digest() != p.slot.hash:
                raise errors.TensorHashMismatch(f"tensor at offset {p.slot.off} does not match its hash", path=p.path)

    def read_file(self, reads: list[tuple[assemble.Piece, list[memoryview]]]) -> None:
        """Pieces of one file, in file order: each run of adjacent pieces in one vectored read, then each hashed."""
        reads = sorted(reads, key=lambda r: r[0].off)
        first = reads[0][0]
        fd = first.fd if first.fd is not None else _open(self.ops, first.path)
        try:
            i = 0
            while i < len(reads):
                j, end = i + 1, reads[i][0].off + reads[i][0].slot.nbytes
                while j < len(reads) and reads[j][0].off == end:
                    end += reads[j][0].slot.nbytes
                    j += 1
                p = reads[i][0]
                fileio.read_all(self.ops, fd, [r for _, runs in reads[i:j] for r in runs], p.off, p.path)
                for q, runs in reads[i:j]:
                    self.check(q, runs)
                i = j
        finally:
            if first.fd is None:
                self.ops.close(fd)


def release(reads: list[tuple[assemble.Piece, list[memoryview]]]) -> None:
    for _, runs in reads:
        for r in runs:
            r.release()


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
    """Hands the codecs tensors that worker threads read ahead (allocation, read and hash on both cores)."""

    def __init__(self, reader: _Reader, arrays: dict[int, mx.array]) -> None:
        self.reader, self.arrays = reader, arrays
        self.provider, self.path = reader.provider, reader.path

    def read(self, slot: fmt.Slot, capacity: int | None = None) -> mx.array:
        return self.arrays.pop(id(slot)) if id(slot) in self.arrays else self.reader.read(slot, capacity)


def _decode_parallel(reader: _Reader, entries: list[fmt.CacheEntry], threads: int) -> list[Any]:
    plan = _Recorder(reader.provider, reader.path)
    for e in entries:
        plan.decode(e)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="spilld-load") as pool:
        if reader.pieces:
            arrays = _read_by_file(reader, plan.wants, pool)
        else:
            futs = {k: pool.submit(reader.read, slot, cap) for k, (slot, cap) in plan.wants.items()}
            arrays = _results(futs)
    ctx = _Prefetched(reader, arrays)
    return [ctx.decode(e) for e in entries]


def _read_by_file(
    reader: _Reader, wants: dict[int, tuple[fmt.Slot, int | None]], pool: concurrent.futures.ThreadPoolExecutor
) -> dict[int, mx.array]:
    """A manifest's tensors: every buffer allocated first, then each file (a block, the manifest) read by one
    task straight into the buffers at their row offsets, adjacent pieces in one vectored read."""
    arrays: dict[int, mx.array] = {}
    by_file: dict[str, list[tuple[assemble.Piece, list[memoryview]]]] = {}
    try:
        allocated = _results({k: pool.submit(reader.alloc, slot, cap) for k, (slot, cap) in wants.items()})
        for k, (arr, reads) in allocated.items():  # (zero fill and page faults on both cores)
            arrays[k] = arr
            for p, runs in reads:
                by_file.setdefault(p.path, []).append((p, runs))
        _results({f: pool.submit(reader.read_file, reads) for f, reads in by_file.items()})
    finally:
        for reads in by_file.values():
            release(reads)
    return arrays


def _results(futs: dict[Any, concurrent.futures.Future[Any]]) -> dict[Any, Any]:
    """Every task's result; on a failure the others are cancelled, or waited for if running (they write into
    buffers the caller releases next)."""
    try:
        return {k: f.result() for k, f in futs.items()}
    except BaseException:
        for f in futs.values():
            f.cancel()
        concurrent.futures.wait(futs.values())
        raise


def _cut(caches: list[Any], header: fmt.Header, upto: int, path: str) -> None:
    """Trim loaded caches back to ``upto`` tokens, where the header says that is valid."""
    if upto > len(header.tokens) or upto < 0:
        raise errors.NotReusable(f"cannot cut {len(header.tokens)} tokens to {upto}", path=path)
    if upto == len(header.tokens):
        return
    if not header.trimmable:
        raise errors.NotReusable("entry is not trimmable (rotated ring, recurrent state or attachments)", path=path)
    if upto < header.min_reusable_offset:
        raise errors.NotReusable(
            f"cannot cut below the minimum reusable offset {header.min_reusable_offset}", path=path
        )
    for c, e in zip(caches, header.caches, strict=True):
        if e.offset is not None and e.offset > upto:
            c.trim(e.offset - upto)


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
    (refused with ``NotReusable`` when the header says it is not valid).
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
                header, fd, p, blocks or assemble.beside(p), lambda b: _block_header_at(b, ops),
                upto=upto, blocks_only=blocks_only,
            )  # fmt: skip
            whole, pieces = plan.header, plan.pieces
        reader = _Reader(fd, whole, prov, verify, ops, p, pieces)
        big = threads > 1 and whole.data_bytes >= PARALLEL_MIN_BYTES
        if big or pieces:  # a manifest's files are read one task each (a small one's on one thread: no GIL hand-offs)
            caches = _decode_parallel(reader, whole.caches, threads if big else 1)
        else:
            caches = [reader.decode(e) for e in whole.caches]
        attachments = [
            Attachment(a.schema, dict(a.metadata), [reader.read(s) for s in a.tensors]) for a in whole.attachments
        ]
    finally:
        ops.close(fd)
    tokens = whole.tokens
    if upto is not None:
        _cut(caches, whole, upto, p)
        tokens = tokens[:upto]
    return Loaded(tokens, caches, header, attachments, whole.checkpoint, header.meta)
