"""The spilld file format: prefix, header and tensor layout. Pure: no I/O.

See docs/format.md for the byte-by-byte description. Everything here works on
bytes and plain values so it can be tested without files or mlx.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from . import errors
from .unpack import unpack

MAGIC = b"\x89SPILLD\n"
# what this build writes: v2 added prefix blocks (a manifest's ``blocks``, a block's ``block``), v3 packed files
FORMAT_VERSION = 3
SUPPORTED_VERSIONS = frozenset({1, 2, 3})

# magic(8) | u32 format version | u32 header length | u64 data start | u64 header hash
PREFIX = struct.Struct("<8sIIQQ")
PREFIX_LEN = PREFIX.size  # 32
ALIGN = 16384  # Apple Silicon page size; a multiple of 4 KiB pages too
# A file whose tensors hold less than this is packed: a page per tensor (and the header's page) would be mostly
# zero padding (a tenth of a tiny model's blocks and tails on disk), and mapping such tensors saves nothing.
COMPACT_ALIGN = 64  # a cache line: every dtype's alignment, and hashing reads whole lines
COMPACT_BELOW = 1024 * 1024
ALIGNS = (ALIGN, COMPACT_ALIGN)
HASH_LEN = 8  # xxh3-64, stored big-endian as an 8-byte msgpack bin
PLACEHOLDER_HASH = b"\x00" * HASH_LEN

# Limits. Each one has its own error and a test that hits it.
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 65_536
MAX_RANK = 8
MAX_DIM = 2**31 - 1
MAX_TOTAL_BYTES = 2**40  # 1 TiB of tensor data in one file
MAX_TOKENS = 8 * 1024 * 1024  # 32 MiB of u32 ids, well inside the header limit
MAX_NESTING = 8  # CacheList inside CacheList ...
MAX_FIELD_DEPTH = 4  # lists and maps inside a cache's field value (the codecs' deepest: a list of scalars)
KEY_LEN = 32  # a block key: SHA-256
MIN_BLOCK_TOKENS = 16  # a manifest's block size B: at least this, so its key list stays short
MAX_BLOCK_TOKENS = 65_536

# Stable dtype names -> item size. Names, not mlx enum values, go into files.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "complex64": 8,
}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def xxh3(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_64_digest(data)


# --- schema -----------------------------------------------------------------


@dataclass
class Slot:
    """One tensor in the data region. ``off`` is relative to the data start."""

    off: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    hash: bytes = PLACEHOLDER_HASH

    def to_wire(self) -> dict[str, Any]:
        return {
            "off": self.off,
            "bytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "hash": self.hash,
        }


@dataclass
class Identity:
    """Who a file is for. A load with ``expect`` compares every field it sets."""

    model_id: str = ""
    config_fingerprint: str = ""
    tokenizer_hash: str = ""
    namespace: str = ""

    def to_wire(self) -> dict[str, str]:
        return {
            "model_id": self.model_id,
            "config_fingerprint": self.config_fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
            "namespace": self.namespace,
        }


@dataclass
class CacheEntry:
    """One cache (layer) as stored: our schema, never mlx-lm's ``state`` layout."""

    kind: str
    version: int
    offset: int | None  # tokens this cache encodes; None for caches with no position (SSM)
    min_reusable: int  # the entry cannot be cut back below this many tokens
    trimmable: bool
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: list[Slot] = field(default_factory=list)
    children: list[CacheEntry] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "v": self.version,
            "offset": self.offset,
            "min_reusable": self.min_reusable,
            "trimmable": self.trimmable,
            "fields": self.fields,
            "tensors": [s.to_wire() for s in self.tensors],
            "children": [c.to_wire() for c in self.children],
        }

    def walk_slots(self) -> list[Slot]:
        out = list(self.tensors)
        for c in self.children:
            out.extend(c.walk_slots())
        return out


@dataclass
class AttachmentEntry:
    schema: str
    metadata: dict[str, str | int | float | bool]
    tensors: list[Slot] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"schema": self.schema, "metadata": self.metadata, "tensors": [s.to_wire() for s in self.tensors]}


@dataclass
class GenerationCheckpoint:
    """An in-flight generation: the caches cover the prompt plus the tokens emitted so far."""

    key: str
    cache_ns: str
    original_prompt_tokens: int
    generated_tokens: int
    pending_token: int | None
    seed: int
    seed_was_explicit: bool

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "cache_ns": self.cache_ns,
            "original_prompt_tokens": self.original_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "pending_token": self.pending_token,
            "seed": self.seed,
            "seed_was_explicit": self.seed_was_explicit,
        }


@dataclass
class BlockList:
    """A manifest's blocks: ``keys[i]`` holds the rows of tokens ``[i*size, (i+1)*size)`` of its positional caches."""

    size: int
    keys: list[bytes]

    def to_wire(self) -> dict[str, Any]:
        return {"size": self.size, "keys": list(self.keys)}

    @property
    def rows(self) -> int:
        """Token rows the blocks hold (the manifest's positional caches store the rows after them)."""
        return self.size * len(self.keys)


@dataclass
class BlockInfo:
    """What makes a block file self-verifying: its key = SHA-256(parent key + its token ids as u32 LE)."""

    key: bytes
    parent: bytes  # the previous block's key; for block 0 the layout's root key (``spilld.blocks.root_key``)
    index: int

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "parent": self.parent, "index": self.index}


@dataclass
class Header:
    """The decoded msgpack header plus the layout facts from the prefix."""

    version: int
    created_at_ms: int
    codec_provider: str
    identity: Identity
    tokens: list[int]
    caches: list[CacheEntry]
    attachments: list[AttachmentEntry] = field(default_factory=list)
    checkpoint: GenerationCheckpoint | None = None
    meta: dict[str, str] = field(default_factory=dict)
    blocks: BlockList | None = None  # v2: a manifest's prefix blocks (None: every row is in this file)
    block: BlockInfo | None = None  # v2: set in a block file, whose ``tokens`` are its own B token ids
    align: int = ALIGN  # v3: COMPACT_ALIGN for a file of fewer than COMPACT_BELOW tensor bytes (``plan_layout``)
    header_len: int = 0  # these three: the prefix's, set by ``decode_header``
    data_start: int = 0
    file_size: int = 0

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.version,
            "created_at_ms": self.created_at_ms,
            "codec_provider": self.codec_provider,
            "identity": self.identity.to_wire(),
            "tokens": encode_tokens(self.tokens),
            "caches": [c.to_wire() for c in self.caches],
            "attachments": [a.to_wire() for a in self.attachments],
            "checkpoint": self.checkpoint.to_wire() if self.checkpoint else None,
            "meta": self.meta,
        }
        if self.version >= 2:
            d["blocks"] = self.blocks.to_wire() if self.blocks else None
            d["block"] = self.block.to_wire() if self.block else None
        if self.version >= 3:
            d["align"] = self.align
        return d

    def slots(self) -> list[Slot]:
        """Every slot in data order: caches (depth first), then attachments."""
        out: list[Slot] = []
        for c in self.caches:
            out.extend(c.walk_slots())
        for a in self.attachments:
            out.extend(a.tensors)
        return out

    @property
    def trimmable(self) -> bool:
        """True when the entry can be reused for a shorter prefix than it stores."""
        return not self.attachments and all(c.trimmable for c in self.caches)

    @property
    def min_reusable_offset(self) -> int:
        return max((c.min_reusable for c in self.caches), default=0)

    @property
    def restorable_tokens(self) -> int:
        """The tokens the caches hold: no more than the least offset any of them records (a file may record
        more tokens than its caches saw; those past the least offset cannot be restored). No caches hold none."""
        if not self.caches:  # (found in review: such a file was a hit for all its tokens, restoring no cache)
            return 0
        offsets: list[int] = []
        stack = list(self.caches)
        while stack:
            c = stack.pop()
            if c.offset is not None:
                offsets.append(c.offset)
            stack.extend(c.children)
        return min([len(self.tokens), *offsets])

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots())


def encode_tokens(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def decode_tokens(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise errors.HeaderMalformed("token bytes are not a multiple of 4")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


# --- layout -----------------------------------------------------------------


def plan_layout(header: Header) -> int:
    """Choose the header's alignment (packed below ``COMPACT_BELOW`` tensor bytes, in v3) and place its tensors;
    return the data length. Every writer plans with this, so the rule is in one place."""
    slots = header.slots()
    small = sum(s.nbytes for s in slots) < COMPACT_BELOW
    header.align = COMPACT_ALIGN if small and header.version >= 3 else ALIGN
    return plan_offsets(slots, header.align)


def plan_offsets(slots: list[Slot], align: int = ALIGN) -> int:
    """Assign aligned offsets in order; return the data length (end of the last byte).

    A zero-byte tensor sits at the next aligned offset and does not extend the file.
    """
    cursor = 0
    end = 0
    for s in slots:
        s.off = align_up(cursor, align)
        cursor = s.off + s.nbytes
        if s.nbytes:
            end = cursor
    return end


def row_spans(
    shape: tuple[int, ...] | list[int], itemsize: int, rows: int | None, start: int = 0
) -> list[tuple[int, int]]:
    """Byte spans (start, length) of rows ``[start, start + rows)`` (axis -2) of a C-ordered buffer.

    With ``rows`` None, or all of the buffer's rows, the whole buffer is one span.
    """
    total = itemsize * math.prod(shape)
    if rows is None or len(shape) < 2 or (rows == shape[-2] and start == 0):
        return [(0, total)] if total else []
    if start < 0 or start + rows > shape[-2]:
        raise ValueError(f"rows [{start}, {start + rows}) of a buffer of {shape[-2]}")
    row = shape[-1] * itemsize
    block = shape[-2] * row
    n = rows * row
    return [(i * block + start * row, n) for i in range(math.prod(shape[:-2]))] if n else []


def check_limits(slots: list[Slot], path: str | None = None) -> None:
    """Tensor count, rank, dimensions and total size: checked on write and on read."""
    if len(slots) > MAX_TENSORS:
        raise errors.TooManyTensors(f"{len(slots)} tensors (limit {MAX_TENSORS})", path=path)
    total = 0
    for i, s in enumerate(slots):
        if len(s.shape) > MAX_RANK:
            raise errors.RankTooLarge(f"tensor {i} has rank {len(s.shape)} (limit {MAX_RANK})", path=path)
        for d in s.shape:
            if d < 0 or d > MAX_DIM:
                raise errors.DimensionTooLarge(f"tensor {i} dimension {d} (limit {MAX_DIM})", path=path)
        total += DTYPE_SIZES[s.dtype] * math.prod(s.shape)
        if total > MAX_TOTAL_BYTES:
            raise errors.TotalSizeTooLarge(f"tensors exceed {MAX_TOTAL_BYTES} bytes", path=path)


def check_nesting(entries: list[CacheEntry], path: str | None = None, depth: int = 0) -> None:
    """Top-level entries are depth 0; a reader refuses anything deeper than MAX_NESTING."""
    for e in entries:
        if depth > MAX_NESTING:
            raise errors.NestingTooDeep(f"cache nesting deeper than {MAX_NESTING}", path=path)
        check_nesting(e.children, path, depth + 1)


def check_layout(header: Header, file_size: int, path: str | None = None) -> None:
    """The data starts where the header's alignment puts it, slots sit exactly where ``plan_offsets`` puts them,
    and the file ends at the last byte.

    Sizes (bytes = shape x itemsize) and limits are ``spilld.validate``'s to check first (it calls this).
    """
    align, data_start, slots = header.align, header.data_start, header.slots()
    if data_start != align_up(PREFIX_LEN + header.header_len, align):
        raise errors.LayoutError(
            f"data start {data_start} does not follow header length {header.header_len} at {align}", path=path
        )
    cursor = 0
    end = 0
    for i, s in enumerate(slots):
        if s.off != align_up(cursor, align):
            raise errors.LayoutError(f"tensor {i} at offset {s.off}, expected {align_up(cursor, align)}", path=path)
        cursor = s.off + s.nbytes
        if s.nbytes:
            end = cursor
    if file_size != data_start + end:
        kind = errors.TruncatedFile if file_size < data_start + end else errors.LayoutError
        raise kind(f"file is {file_size} bytes, layout needs {data_start + end}", path=path)


# --- prefix and header bytes --------------------------------------------------


def pack_header(header: Header) -> bytes:
    return msgpack.packb(header.to_wire(), use_bin_type=True)


def encode_prefix(header_bytes: bytes, version: int = FORMAT_VERSION, align: int = ALIGN) -> tuple[bytes, int]:
    """Return (prefix + header + zero padding up to the data start, data start). ``align`` is the header's."""
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise errors.HeaderTooLarge(f"header is {len(header_bytes)} bytes (limit {MAX_HEADER_BYTES})")
    data_start = align_up(PREFIX_LEN + len(header_bytes), align)
    prefix = PREFIX.pack(MAGIC, version, len(header_bytes), data_start, int.from_bytes(xxh3(header_bytes), "big"))
    head = prefix + header_bytes
    return head + b"\x00" * (data_start - len(head)), data_start


@dataclass
class Prefix:
    version: int
    header_len: int
    data_start: int
    header_hash: bytes


def decode_prefix(raw: bytes, file_size: int, path: str | None = None) -> Prefix:
    """Check magic, version and that every length fits in the file, before anything is allocated."""
    if len(raw) < PREFIX_LEN:
        if raw[: len(MAGIC)] != MAGIC[: len(raw)]:
            raise errors.BadMagic("not a spilld file", path=path)
        raise errors.TruncatedFile(f"file is {file_size} bytes, shorter than the prefix", path=path)
    magic, version, header_len, data_start, hash_int = PREFIX.unpack(raw[:PREFIX_LEN])
    if magic != MAGIC:
        raise errors.BadMagic("not a spilld file", path=path)
    if version not in SUPPORTED_VERSIONS:
        raise errors.UnsupportedVersion(
            f"format version {version} (this reader knows {sorted(SUPPORTED_VERSIONS)})", path=path
        )
    if header_len > MAX_HEADER_BYTES:
        raise errors.HeaderTooLarge(f"header length {header_len} (limit {MAX_HEADER_BYTES})", path=path)
    # which alignment is the header's to say (``decode_header`` checks it); here only that it is one of them
    if all(data_start != align_up(PREFIX_LEN + header_len, a) for a in ALIGNS):
        raise errors.LayoutError(f"data start {data_start} does not follow header length {header_len}", path=path)
    if data_start > file_size:
        raise errors.TruncatedFile(f"file is {file_size} bytes, data starts at {data_start}", path=path)
    return Prefix(version, header_len, data_start, hash_int.to_bytes(HASH_LEN, "big"))


def check_padding(pad: bytes, path: str | None = None) -> None:
    if pad.count(0) != len(pad):
        raise errors.PaddingNotZero("bytes between header and data start are not zero", path=path)


def decode_header(header_bytes: bytes, prefix: Prefix, file_size: int, path: str | None = None) -> Header:
    """Verify the header hash, unpack msgpack and type-check every field.

    Only the wire types: what the fields say (versions, layout, codec rules) is checked
    next by ``spilld.validate.validate_header``, which every reader runs.
    """
    if xxh3(header_bytes) != prefix.header_hash:
        raise errors.HeaderHashMismatch("header hash mismatch (corrupt or truncated)", path=path)
    try:
        raw = unpack(header_bytes)  # objects bounded by its size: a 64 MiB header of empty maps would be ~4.6 GiB
    except Exception as exc:  # msgpack raises several unrelated types
        raise errors.HeaderMalformed(f"header is not valid msgpack: {exc}", path=path) from exc
    try:
        header = _header_from_wire(raw, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.HeaderMalformed(f"header field invalid: {_said(exc)}", path=path) from exc
    except errors.FileFormatError as exc:
        if exc.path is None and path is not None:
            raise type(exc)(exc.reason, path=path) from exc
        raise
    header.header_len = prefix.header_len
    header.data_start = prefix.data_start
    header.file_size = file_size
    return header


# --- typed readers for wire dicts ---------------------------------------------


def _want(v: Any, t: type | tuple[type, ...], what: str) -> Any:
    if type(v) is t:  # msgpack's own types: the common case, one test (a header has thousands of fields)
        return v
    if isinstance(v, bool) and t in (int, (int,)):
        raise TypeError(f"{what}: expected int, got bool")
    if not isinstance(v, t):
        raise TypeError(f"{what}: expected {t}, got {type(v).__name__}")
    return v


def _int(v: Any, what: str, lo: int = 0) -> int:
    if type(v) is not int:  # a bool is not an int here
        _want(v, int, what)
    if v < lo:
        raise ValueError(f"{what}: {v} < {lo}")
    return int(v)


def _slot_from_wire(d: Any) -> Slot:
    _want(d, dict, "slot")
    shape = _want(d["shape"], list, "slot.shape")
    if len(shape) > MAX_RANK:
        raise errors.RankTooLarge(f"tensor rank {len(shape)} (limit {MAX_RANK})")
    dtype = _want(d["dtype"], str, "slot.dtype")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}")
    h = _want(d["hash"], bytes, "slot.hash")
    if len(h) != HASH_LEN:
        raise ValueError("slot.hash must be 8 bytes")
    return Slot(
        off=_int(d["off"], "slot.off"),
        nbytes=_int(d["bytes"], "slot.bytes"),
        shape=tuple(_int(x, "slot.shape[]") for x in shape),
        dtype=dtype,
        hash=h,
    )


def _slots_from_wire(v: Any) -> list[Slot]:
    _want(v, list, "tensors")
    if len(v) > MAX_TENSORS:
        raise errors.TooManyTensors(f"{len(v)} tensors (limit {MAX_TENSORS})")
    return [_slot_from_wire(s) for s in v]


def _entry_from_wire(d: Any, depth: int = 0) -> CacheEntry:
    if depth > MAX_NESTING:
        raise errors.NestingTooDeep(f"cache nesting deeper than {MAX_NESTING}")
    _want(d, dict, "cache")
    offset = d["offset"]
    if offset is not None:
        offset = _int(offset, "cache.offset")
        if offset > MAX_DIM:  # a position mlx's rope takes: bounded even in a file without tokens to compare it with
            raise errors.DimensionTooLarge(f"cache.offset {offset} > {MAX_DIM}")
    mr = _int(d["min_reusable"], "cache.min_reusable")
    if offset is not None and mr > offset:
        raise ValueError(f"min_reusable {mr} > offset {offset}")
    children = _want(d["children"], list, "cache.children")
    return CacheEntry(
        kind=_want(d["kind"], str, "cache.kind"),
        version=_int(d["v"], "cache.v", 1),
        offset=offset,
        min_reusable=mr,
        trimmable=_want(d["trimmable"], bool, "cache.trimmable"),
        fields=_fields(d["fields"]),
        tensors=_slots_from_wire(d["tensors"]),
        children=[_entry_from_wire(c, depth + 1) for c in children],
    )


def _checkpoint_from_wire(d: Any) -> GenerationCheckpoint | None:
    if d is None:
        return None
    _want(d, dict, "checkpoint")
    pending = d["pending_token"]
    return GenerationCheckpoint(
        key=_want(d["key"], str, "checkpoint.key"),
        cache_ns=_want(d["cache_ns"], str, "checkpoint.cache_ns"),
        original_prompt_tokens=_int(d["original_prompt_tokens"], "checkpoint.original_prompt_tokens"),
        generated_tokens=_int(d["generated_tokens"], "checkpoint.generated_tokens"),
        pending_token=None if pending is None else _int(pending, "checkpoint.pending_token"),
        seed=_int(d["seed"], "checkpoint.seed", lo=-(2**63)),
        seed_was_explicit=_want(d["seed_was_explicit"], bool, "checkpoint.seed_was_explicit"),
    )


def _fields(d: Any) -> dict[str, Any]:
    """A cache's fields: names are text (a bytes name beside a text one could never be put in order, §5.2's key),
    values nested at most ``MAX_FIELD_DEPTH`` deep (a block key packs them again, one level deeper)."""
    _want(d, dict, "cache.fields")
    for k, v in d.items():
        _want(k, str, "cache.fields key")
        _check_depth(v, MAX_FIELD_DEPTH, k)
    return dict(d)


def _check_depth(v: Any, left: int, name: str) -> None:
    if isinstance(v, (list, dict)):
        if left == 0:
            raise errors.NestingTooDeep(f"cache field {name!r} nests lists or maps deeper than {MAX_FIELD_DEPTH}")
        for x in v.values() if isinstance(v, dict) else v:
            _check_depth(x, left - 1, name)


def _metadata(d: Any) -> dict[str, str | int | float | bool]:
    _want(d, dict, "attachment.metadata")
    for k, v in d.items():
        _want(k, str, "attachment.metadata key")
        _want(v, (str, int, float, bool), f"attachment.metadata[{k!r}]")
    return d


def _key(v: Any, what: str) -> bytes:
    _want(v, bytes, what)
    if len(v) != KEY_LEN:
        raise ValueError(f"{what} must be {KEY_LEN} bytes")
    return bytes(v)


def _blocks_from_wire(d: Any) -> BlockList | None:
    if d is None:
        return None
    _want(d, dict, "blocks")
    size = _int(d["size"], "blocks.size", MIN_BLOCK_TOKENS)
    if size > MAX_BLOCK_TOKENS:
        raise errors.FieldInvalid(f"block size {size} (limit {MAX_BLOCK_TOKENS})")
    keys = _want(d["keys"], list, "blocks.keys")
    if len(keys) > MAX_TOKENS // size:
        raise errors.TooManyTokens(f"{len(keys)} blocks of {size} tokens (limit {MAX_TOKENS} tokens)")
    return BlockList(size, [_key(k, "blocks.keys[]") for k in keys])


def _block_from_wire(d: Any) -> BlockInfo | None:
    if d is None:
        return None
    _want(d, dict, "block")
    return BlockInfo(
        key=_key(d["key"], "block.key"),
        parent=_key(d["parent"], "block.parent"),
        index=_int(d["index"], "block.index"),
    )


def _align_from_wire(v: Any) -> int:
    if _want(v, int, "align") not in ALIGNS:
        raise errors.FieldInvalid(f"alignment {v} (one of {list(ALIGNS)})")
    return int(v)


def _said(exc: Exception) -> str:
    # in words for the user (the text may cross a socket), never a Python repr
    return f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)


def header_from_wire(raw: Any, path: str | None = None) -> Header:
    """Type-check a header map (as msgpack decodes it) into a Header; HeaderMalformed on anything off."""
    try:
        return _header_from_wire(raw, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.HeaderMalformed(f"header field invalid: {_said(exc)}", path=path) from exc


def _header_from_wire(raw: Any, path: str | None) -> Header:
    _want(raw, dict, "header")
    ident = _want(raw["identity"], dict, "identity")
    token_bytes = _want(raw["tokens"], bytes, "tokens")
    if len(token_bytes) // 4 > MAX_TOKENS:
        raise errors.TooManyTokens(f"{len(token_bytes) // 4} tokens (limit {MAX_TOKENS})", path=path)
    attachments = []
    for a in _want(raw["attachments"], list, "attachments"):
        _want(a, dict, "attachment")
        attachments.append(
            AttachmentEntry(
                schema=_want(a["schema"], str, "attachment.schema"),
                metadata=_metadata(a["metadata"]),
                tensors=_slots_from_wire(a["tensors"]),
            )
        )
    meta = _want(raw["meta"], dict, "meta")
    for k, v in meta.items():
        _want(k, str, "meta key")
        _want(v, str, f"meta[{k!r}]")
    tokens = decode_tokens(token_bytes)
    checkpoint = _checkpoint_from_wire(raw["checkpoint"])
    if checkpoint is not None:
        if checkpoint.original_prompt_tokens + checkpoint.generated_tokens != len(tokens):
            raise errors.CheckpointInconsistent(
                f"checkpoint covers {checkpoint.original_prompt_tokens}+{checkpoint.generated_tokens} tokens, file has {len(tokens)}",
                path=path,
            )
    version = _int(raw["format"], "format", 1)
    return Header(
        version=version,
        created_at_ms=_int(raw["created_at_ms"], "created_at_ms"),
        codec_provider=_want(raw["codec_provider"], str, "codec_provider"),
        identity=Identity(**{k: _want(ident[k], str, f"identity.{k}") for k in Identity().to_wire()}),
        tokens=tokens,
        caches=[_entry_from_wire(c) for c in _want(raw["caches"], list, "caches")],
        attachments=attachments,
        checkpoint=checkpoint,
        meta=meta,
        blocks=_blocks_from_wire(raw["blocks"]) if version >= 2 else None,
        block=_block_from_wire(raw["block"]) if version >= 2 else None,
        align=_align_from_wire(raw["align"]) if version >= 3 else ALIGN,
    )
