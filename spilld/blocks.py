"""Prefix blocks (format v2): keys, layouts, and the split of a planned entry into blocks and a manifest.

A block holds the rows of ``size`` consecutive tokens of every *positional* cache of an entry: a cache whose
rows are a pure function of the token prefix and stored as ``rows == offset`` (kv, concat, quantized, and those
inside a list). Keys chain: ``key_i = SHA-256(key_{i-1} + token ids of block i)``, ``key_{-1}`` = the layout's
root key, a SHA-256 of the identity, the codec provider, the block size and the positional layout. Two entries
that share k full blocks of prefix name the same k block files.

Pure: no mlx, no I/O. Sources are sliced through their ``row_slice`` (mlx arrays, live caches, received bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from . import format as fmt
from .codecs.rules import Rows, rules_for

DEFAULT_BLOCK_TOKENS = (
    64  # chosen by scripts/bench/chat_wear.py (docs/benchmarks.md): the smallest write and disk amplification
)
BLOCK_EXT = ".spilld-block"
_KEY_DOMAIN = "spilld-blocks/1"


def block_name(key: bytes) -> str:
    """A new file name for block ``key``: ``<key hex>-<8 random hex>.spilld-block``. The suffix keeps a block
    written again from sharing a name with the unlink still pending for the old one."""
    return f"{key.hex()}-{secrets.token_hex(4)}{BLOCK_EXT}"


def key_of_name(name: str) -> bytes | None:
    """The block key a file name says (``block_name``'s rule), or None for a name that is not a block's."""
    if not name.endswith(BLOCK_EXT):
        return None
    try:
        key = bytes.fromhex(name.split("-", 1)[0])
    except ValueError:
        return None
    return key if len(key) == fmt.KEY_LEN else None


def is_positional(entry: fmt.CacheEntry, provider: str) -> bool:
    """Rows stored as ``rows == offset`` and never rewritten below it: a pure function of the token prefix."""
    table = rules_for(provider)
    rule = table.get(entry.kind) if table is not None else None
    return rule is not None and rule.rows is Rows.OFFSET and not entry.children


def walk(entries: Sequence[fmt.CacheEntry], start: int = 0) -> Iterator[tuple[fmt.CacheEntry, int]]:
    """Every entry depth first, with the index of its first slot in the header's slot order."""
    i = start
    for e in entries:
        yield e, i
        i += len(e.tensors)
        yield from walk(e.children, i)
        i += sum(len(c.walk_slots()) for c in e.children)


def positional_leaves(header: fmt.Header) -> list[tuple[fmt.CacheEntry, int]]:
    return [(e, i) for e, i in walk(header.caches) if is_positional(e, header.codec_provider)]


def whole(header: fmt.Header) -> bool:
    """Every cache with state is positional: its blocks alone restore it (attachments aside)."""
    return bool(header.caches) and all(
        e.children or is_positional(e, header.codec_provider) for e, _ in walk(header.caches)
    )


def layout_of(leaves: Sequence[fmt.CacheEntry]) -> list[Any]:
    """What a block's bytes mean, without their rows: kind, codec version, fields, dtypes, other dimensions."""
    return [
        [e.kind, e.version, sorted(e.fields.items()), [[s.dtype, [*s.shape[:-2], s.shape[-1]]] for s in e.tensors]]
        for e in leaves
    ]


def root_key(identity: fmt.Identity, provider: str, size: int, layout: list[Any]) -> bytes:
    ident = [identity.model_id, identity.config_fingerprint, identity.tokenizer_hash, identity.namespace]
    blob = msgpack.packb([_KEY_DOMAIN, *ident, provider, size, layout], use_bin_type=True)
    return hashlib.sha256(blob).digest()


def next_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    h = hashlib.sha256(parent)  # an array's ids hashed in place: no copy of them, nor of the two joined
    h.update(token_bytes(tokens) if isinstance(tokens, np.ndarray) else fmt.encode_tokens(list(tokens)))
    return h.digest()


def token_bytes(tokens: np.ndarray) -> memoryview:
    """``tokens`` as the u32 little-endian buffer ``format.encode_tokens`` writes (no copy of a token array)."""
    return np.ascontiguousarray(tokens, dtype="<u4").data


def chain(root: bytes, tokens: Sequence[int] | np.ndarray, size: int, count: int) -> list[bytes]:
    """The keys of the first ``count`` full blocks of ``tokens``."""
    keys, key = [], root
    for i in range(count):
        key = next_key(key, tokens[i * size : (i + 1) * size])
        keys.append(key)
    return keys


def header_layout(header: fmt.Header) -> list[Any]:
    """The layout of a manifest's positional leaves, or of a block's own entries."""
    return layout_of([e for e, _ in positional_leaves(header)])


def header_root(header: fmt.Header, size: int, layout: list[Any] | None = None) -> bytes:
    """The root key of a manifest or a block (``layout``: its ``header_layout``, when already made)."""
    return root_key(header.identity, header.codec_provider, size, header_layout(header) if layout is None else layout)


@dataclass
class Split:
    """A planned entry cut into its blocks (planned on demand: most already exist) and its manifest."""

    header: fmt.Header
    sources: list[Any]
    size: int
    keys: list[bytes]
    root: bytes
    leaves: list[tuple[fmt.CacheEntry, int]]  # the positional leaves and their first slot index

    @property
    def block_bytes(self) -> int:
        """Tensor bytes of each block (every block of a cut holds as many rows)."""
        return sum(rows_slot(s, self.size).nbytes for e, _ in self.leaves for s in e.tensors)

    def block(self, i: int) -> tuple[fmt.Header, list[Any]]:
        """Block ``i``: a file of its own (the same identity and provider), rows ``[i*size, (i+1)*size)``."""
        lo = i * self.size
        srcs = [
            self.sources[first + j].row_slice(lo, self.size) for e, first in self.leaves for j in range(len(e.tensors))
        ]
        return block_header(self.header, self.leaves, self.size, self.keys, self.root, i), srcs

    def manifest(self) -> tuple[fmt.Header, list[Any]]:
        """The entry with its positional caches cut to the rows after the blocks, and the keys of the blocks."""
        base = len(self.keys) * self.size
        srcs = list(self.sources)
        cut = {id(e) for e, _ in self.leaves}
        for e, first in self.leaves:
            rows = (e.offset or 0) - base
            for j in range(len(e.tensors)):
                srcs[first + j] = srcs[first + j].row_slice(base, rows)
        m = dataclasses.replace(
            self.header,
            caches=[_tail_entry(e, cut, base) for e in self.header.caches],
            blocks=fmt.BlockList(self.size, self.keys),
        )
        fmt.plan_layout(m)
        return m, srcs


def _tail_entry(e: fmt.CacheEntry, cut: set[int], base: int) -> fmt.CacheEntry:
    """``e`` with the positional caches among it (``cut``, by id) cut to their rows after ``base``."""
    if id(e) in cut:
        tail = (e.offset or 0) - base
        return dataclasses.replace(e, tensors=[rows_slot(s, tail) for s in e.tensors])
    return dataclasses.replace(e, children=[_tail_entry(c, cut, base) for c in e.children])


def block_header(
    h: fmt.Header, leaves: Sequence[tuple[fmt.CacheEntry, int]], size: int, keys: Sequence[bytes], root: bytes, i: int
) -> fmt.Header:
    """The header of block ``i`` of entry ``h`` (its positional ``leaves``, its ``keys`` chained from ``root``),
    laid out: what this build writes (``Split.block``), and what a load expects to read (``assemble``)."""
    lo = i * size
    entries = [
        fmt.CacheEntry(e.kind, e.version, size, 0, True, dict(e.fields), [rows_slot(s, size) for s in e.tensors])
        for e, _ in leaves
    ]
    info = fmt.BlockInfo(keys[i], keys[i - 1] if i else root, i)
    bh = fmt.Header(
        fmt.FORMAT_VERSION, h.created_at_ms, h.codec_provider, h.identity, list(h.tokens[lo : lo + size]), entries,
        block=info,
    )  # fmt: skip
    fmt.plan_layout(bh)
    return bh


def split(header: fmt.Header, sources: Sequence[Any], size: int) -> Split | None:
    """The blocks and manifest of a planned entry; None when it holds no full block (write it whole)."""
    if header.block is not None or header.blocks is not None or header.version < 2 or size <= 0:
        return None
    leaves = positional_leaves(header)
    # whole blocks every positional cache holds (rows of the prefix, so never past the tokens)
    k = min([e.offset or 0 for e, _ in leaves] + [len(header.tokens)]) // size if leaves else 0
    if k == 0:
        return None
    root = root_key(header.identity, header.codec_provider, size, layout_of([e for e, _ in leaves]))
    return Split(header, list(sources), size, chain(root, header.tokens, size, k), root, leaves)


def positional_slots(header: fmt.Header) -> list[int]:
    """The indices (in slot order) of the tensors of the positional caches: those whose rows blocks hold."""
    return [first + j for e, first in positional_leaves(header) for j in range(len(e.tensors))]


def cache_bytes(header: fmt.Header) -> int:
    """Tensor bytes of the whole cache a file describes: a manifest's own and its blocks' rows."""
    b = header.blocks
    if b is None:
        return header.data_bytes
    per_block = sum(rows_slot(s, b.size).nbytes for e, _ in positional_leaves(header) for s in e.tensors)
    return header.data_bytes + per_block * len(b.keys)


def rows_slot(s: fmt.Slot, rows: int) -> fmt.Slot:
    """``s`` with ``rows`` rows (axis -2), unplaced."""
    shape = (*s.shape[:-2], rows, s.shape[-1])
    nbytes = fmt.DTYPE_SIZES[s.dtype]
    for d in shape:
        nbytes *= d
    return fmt.Slot(0, nbytes, shape, s.dtype)


def after_held(header: fmt.Header, held: int) -> list[tuple[fmt.Slot, int]]:
    """Each tensor's slot as sent when the daemon holds the blocks of the first ``held`` tokens, with the row it
    starts at: a positional tensor cut to its rows from ``held`` on, any other whole (row 0). ``ValueError`` if a
    positional tensor has fewer than ``held`` rows."""
    out = [(s, 0) for s in header.slots()]
    for i in positional_slots(header) if held else ():
        s = out[i][0]
        if s.shape[-2] < held:
            raise ValueError(f"{held} rows held of a tensor of {s.shape[-2]}")
        out[i] = (rows_slot(s, s.shape[-2] - held), held)
    return out
