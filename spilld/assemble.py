"""Reading a v2 manifest: its blocks checked against it, and each positional tensor assembled from pieces.

The codecs never see blocks: a manifest's positional caches are handed to them as ordinary entries whose
tensors hold every row (the blocks' and the manifest's tail), and each such tensor is read piece by piece
straight into its one buffer, every piece's hash checked. What may be read is decided here, before any
allocation: each block named is opened, its header validated (its own key, its chain, its tokens) and
compared with the manifest (identity, provider, layout, tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import blocks, errors
from . import format as fmt
from .lru import LRU
from .unpack import unpack

BlockPaths = Callable[[bytes], str | None]  # a block key -> its file (None: not on disk)
# A block's header from its prefix, its first bytes (prefix, header, padding) and its file size when they are
# exactly what a manifest expects (``Expected.header``); None: the caller runs the validator.
ExpectFn = Callable[[fmt.Prefix, bytes, int], fmt.Header | None]
ReadBlock = Callable[[str, ExpectFn], fmt.Header]  # a block file's validated header


@dataclass(slots=True)
class Piece:
    """Rows of one tensor, contiguous in one file: ``rows`` rows per leading index, at ``off``."""

    fd: int | None  # None: opened by path when read (a load holds no fd per block: a long prefix has hundreds)
    path: str
    off: int
    rows: int
    slot: fmt.Slot  # as stored (its bytes and hash)
    # Set by the reader when it allocates the buffer the piece fills: the buffer's layout (``into``) and the row
    # its rows start at. Kept on the piece, not beside it: a 1 GiB load has 8,256 pieces, each object one more
    # for the garbage collector to promote and scan while the load runs.
    into: Any = None
    first: int = 0


@dataclass
class Plan:
    """A manifest made whole: the entries the codecs decode, and where each positional tensor's rows are."""

    header: fmt.Header  # tokens, caches (positional tensors with every row they load), attachments
    pieces: dict[int, list[Piece]]  # id(slot of ``header``) -> its pieces, in row order


def beside(manifest_path: str) -> BlockPaths:
    """Blocks in the manifest's own folder (``<key hex>-<suffix>.spilld-block``): a standalone load's resolver.

    The folder is listed once, on the first block asked for.
    """
    folder = os.path.dirname(manifest_path)
    found: dict[bytes, str] = {}

    def find(key: bytes) -> str | None:
        if not found:
            try:
                with os.scandir(folder) as it:
                    for d in it:
                        if (k := blocks.key_of_name(d.name)) is not None:
                            found.setdefault(k, d.path)
            except OSError:
                return None
        return found.get(key)

    return find


def blocks_wanted(header: fmt.Header, upto: int | None, blocks_only: bool) -> tuple[int, bool]:
    """How many of a manifest's blocks a load reads, and whether it reads the tail (the rows after them).

    A load cut to ``upto`` tokens reads only the blocks that hold them when every top-level cache is positional
    (each is then cut on its own); ``blocks_only`` (a restore from another conversation's blocks) reads those
    blocks and nothing of the manifest's own.
    """
    b = header.blocks
    assert b is not None
    if blocks_only:
        if upto is None or upto % b.size or upto > b.rows or not blocks.whole(header):
            raise errors.NotReusable("a restore from blocks alone needs whole blocks of an all-positional layout")
        return upto // b.size, False
    flat = all(blocks.is_positional(e, header.codec_provider) for e in header.caches)
    if upto is not None and upto <= b.rows and flat and not header.attachments:
        return math.ceil(upto / b.size), False
    return len(b.keys), True


class Expected:
    """The block headers this build writes for a validated manifest ``m``. A block whose header bytes are exactly
    those (with its own tensor hashes and time) needs no run of the validator: every rule it checks holds for
    them by construction (the manifest's keys are the chain of its tokens, its layout was checked). Parsing and
    validating a header costs ~30 us a tensor, so a restore in a fresh process, which has read no block yet,
    spent most of its time there. Anything else (a v2 block, a damaged one) is left to the validator."""

    def __init__(self, m: fmt.Header, layout: list[object] | None = None) -> None:
        assert m.blocks is not None
        self.m, self.size, self.keys = m, m.blocks.size, m.blocks.keys
        self.root = blocks.header_root(m, self.size, layout)
        # block 0 as written; every block differs from it only in its tokens, key, time and hashes
        self.tpl = blocks.block_header(m, blocks.positional_leaves(m), self.size, self.keys, self.root, 0)
        slots = self.tpl.slots()
        self.end = max((s.off + s.nbytes for s in slots if s.nbytes), default=0)
        self.tensors = len(slots)

    def header(self, i: int, prefix: fmt.Prefix, raw: bytes, size: int) -> fmt.Header | None:
        """Block ``i``'s header, when ``raw`` (bytes ``[0, D)`` of a file of ``size`` bytes) is what it must be."""
        head = raw[fmt.PREFIX_LEN : fmt.PREFIX_LEN + prefix.header_len]
        try:
            wire = unpack(head)
            created = wire["created_at_ms"]
            hashes = [t["hash"] for c in wire["caches"] for t in c["tensors"]]
        except Exception:  # any shape msgpack decodes, or fails to: the validator names what is wrong
            return None
        tpl = self.tpl
        if type(created) is not int or created < 0 or len(hashes) != self.tensors:
            return None
        if any(type(h) is not bytes or len(h) != fmt.HASH_LEN for h in hashes):
            return None
        it = iter(hashes)
        entries = [
            fmt.CacheEntry(e.kind, e.version, e.offset, e.min_reusable, e.trimmable, dict(e.fields),
                           [fmt.Slot(s.off, s.nbytes, s.shape, s.dtype, next(it)) for s in e.tensors])
            for e in tpl.caches
        ]  # fmt: skip
        lo = i * self.size
        info = fmt.BlockInfo(self.keys[i], self.keys[i - 1] if i else self.root, i)
        bh = dataclasses.replace(
            tpl, created_at_ms=created, tokens=self.m.tokens[lo : lo + self.size], caches=entries, block=info
        )
        if prefix.version != bh.version or fmt.pack_header(bh) != head or fmt.xxh3(head) != prefix.header_hash:
            return None
        pad = raw[fmt.PREFIX_LEN + len(head) : prefix.data_start]
        if prefix.data_start != fmt.align_up(fmt.PREFIX_LEN + len(head), bh.align) or pad.count(0) != len(pad):
            return None
        if size != prefix.data_start + self.end:
            return None
        bh.header_len, bh.data_start, bh.file_size = len(head), prefix.data_start, size
        return bh


def checked_blocks(
    m: fmt.Header, path: str, resolve: BlockPaths, read: ReadBlock, count: int
) -> list[tuple[str, fmt.Header]]:
    """The first ``count`` blocks manifest ``m`` (at ``path``) names: each found, read (``read`` validates its
    header, or takes it as ``Expected`` says) and checked against ``m``; ``BlockMissing`` for one not on disk."""
    b = m.blocks
    assert b is not None
    layout = blocks.header_layout(m)
    expected = Expected(m, layout)
    out = []
    for i in range(count):
        bpath = resolve(b.keys[i])
        if bpath is None:
            raise errors.BlockMissing(f"block {i} ({b.keys[i].hex()[:16]}) is not on disk", path=path)
        bh = read(bpath, functools.partial(expected.header, i))
        check_block(bh, m, i, expected.root, layout, bpath)
        out.append((bpath, bh))
    return out


def open_plan(
    header: fmt.Header,
    fd: int,
    path: str,
    resolve: BlockPaths,
    read_block: ReadBlock,
    *,
    upto: int | None = None,
    blocks_only: bool = False,
) -> Plan:
    """Check the blocks a load needs against the manifest and plan every positional tensor's pieces."""
    use, tail = blocks_wanted(header, upto, blocks_only)
    return _plan(header, fd, path, checked_blocks(header, path, resolve, read_block, use), use, tail)


def check_block(bh: fmt.Header, m: fmt.Header, i: int, root: bytes, layout: list[object], path: str) -> None:
    """Block ``i`` of manifest ``m`` is the one it names: key, chain, index, tokens, identity and layout."""
    b = m.blocks
    assert b is not None
    info = bh.block
    if info is None:
        raise errors.BlockInvalid("a manifest names a file that is not a block", path=path)
    want_parent = b.keys[i - 1] if i else root
    if info.key != b.keys[i] or info.index != i or info.parent != want_parent:
        raise errors.BlockKeyMismatch(f"block {i} is not the one the manifest names", path=path)
    if bh.tokens != m.tokens[i * b.size : (i + 1) * b.size]:
        raise errors.BlockKeyMismatch(f"block {i} holds other tokens than the manifest", path=path)
    if bh.identity != m.identity or bh.codec_provider != m.codec_provider:
        raise errors.BlockInvalid(f"block {i} belongs to another identity or codec provider", path=path)
    if _layout_of(bh.caches) != layout:
        raise errors.BlockInvalid(f"block {i} has another cache layout than the manifest", path=path)


LAYOUTS_CACHED = 1024  # block layouts remembered per process: as many as the loader remembers block headers
_layouts: LRU[int, tuple[list[fmt.CacheEntry], list[object]]] = LRU(LAYOUTS_CACHED)


def _layout_of(caches: list[fmt.CacheEntry]) -> list[object]:
    """``blocks.layout_of(caches)``, remembered for the list it was computed from (kept alive with it, so its id is
    not reused): a block header the loader remembers is checked again on every restore that reads it, and its
    layout cost ~25 us of a 1 GiB restore's 128 blocks each time. A header's caches are never changed in place."""
    got = _layouts.get(id(caches))
    if got is not None and got[0] is caches:
        return got[1]
    layout = blocks.layout_of(caches)
    _layouts.put(id(caches), (caches, layout))
    return layout


def _plan(m: fmt.Header, fd: int, path: str, stored: list[tuple[str, fmt.Header]], use: int, tail: bool) -> Plan:
    p = _Planner(m, fd, path, stored, use, tail)
    caches = [p.entry(e) for e in m.caches]
    tokens = m.tokens if tail else m.tokens[: p.rows_loaded]
    attachments = m.attachments if tail else []
    checkpoint = m.checkpoint if tail else None
    v = dataclasses.replace(m, caches=caches, tokens=tokens, attachments=attachments, checkpoint=checkpoint)
    return Plan(v, p.pieces)


class _Planner:
    """Each positional tensor of manifest ``m`` as the pieces of the ``stored`` blocks it reads (and its tail).

    A class, not a closure: a nested function that calls itself is a reference cycle, which kept every piece of a
    load (8,256 for 1 GiB at B = 64) alive until a full garbage collection (55-64 ms, on the calling thread)."""

    def __init__(
        self, m: fmt.Header, fd: int, path: str, stored: list[tuple[str, fmt.Header]], use: int, tail: bool
    ) -> None:
        assert m.blocks is not None
        self.m, self.fd, self.path, self.stored, self.tail = m, fd, path, stored, tail
        self.size = m.blocks.size
        self.rows_loaded = use * self.size
        self.index = {id(e): n for n, (e, _) in enumerate(blocks.positional_leaves(m))}
        self.pieces: dict[int, list[Piece]] = {}

    def entry(self, e: fmt.CacheEntry) -> fmt.CacheEntry:
        n = self.index.get(id(e))
        if n is None:
            kids = [self.entry(c) for c in e.children]
            if not kids:
                return e
            offs = [c.offset for c in kids if c.offset is not None]
            return dataclasses.replace(e, children=kids, offset=max(offs) if offs else None)
        slots = []
        size = self.size
        per_block = [(bp, bh.data_start, bh.caches[n].tensors) for bp, bh in self.stored]
        for j, s in enumerate(e.tensors):
            parts = [Piece(None, bp, start + ts[j].off, size, ts[j]) for bp, start, ts in per_block]
            if self.tail:
                parts.append(Piece(self.fd, self.path, self.m.data_start + s.off, s.shape[-2], s))
            rows = sum(p.rows for p in parts)
            shape = (*s.shape[:-2], rows, s.shape[-1])
            v = fmt.Slot(0, fmt.DTYPE_SIZES[s.dtype] * math.prod(shape), shape, s.dtype)
            self.pieces[id(v)] = parts
            slots.append(v)
        off = (e.offset or 0) if self.tail else self.rows_loaded
        return dataclasses.replace(e, tensors=slots, offset=off)
