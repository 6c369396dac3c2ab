"""One validator for every header, whoever holds it: the loader, ``spilld verify``,
the index scan and the daemon (a spill's header, before it is accepted).

Pure: no mlx, no I/O. It checks what a header says against itself, against the
file's size and against the rules its codec provider states as data
(``spilld.codecs.rules``). Nothing a header declares is trusted: slot sizes are
computed from shapes, offsets from rows, capacities from rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import blocks, errors
from . import format as fmt
from .codecs.rules import (
    MAX_ARRAY_SLOTS,
    QUANT_BITS,
    QUANT_GROUP_SIZES,
    FieldType,
    KindRule,
    MinReusable,
    Offset,
    Rows,
    Tensor,
    Trim,
    rules_for,
    unruled_kinds,
)

_ANY = Tensor("state", None, None)


def validate_header(
    header: fmt.Header,
    file_size: int | None = None,
    *,
    prefix_version: int = fmt.FORMAT_VERSION,
    path: str | None = None,
) -> None:
    """Refuse, with a typed ``FileFormatError`` (or a codec compatibility error), any header
    that no writer of its codec provider produces.

    ``file_size`` given: the layout must also match the file byte for byte. ``prefix_version``
    is the version of the prefix the header sits under (for a spill: the one the daemon writes).
    """
    try:
        _validate(header, file_size, prefix_version)
    except errors.SpillError as exc:
        if exc.path is None and path is not None:
            raise type(exc)(exc.reason, path=path) from exc
        raise


def _validate(header: fmt.Header, file_size: int | None, prefix_version: int) -> None:
    if header.version != prefix_version:
        raise errors.VersionMismatch(f"header format {header.version} under a prefix of version {prefix_version}")
    fmt.check_nesting(header.caches)
    slots = header.slots()
    fmt.check_limits(slots)
    for i, s in enumerate(slots):
        want = fmt.DTYPE_SIZES[s.dtype] * math.prod(s.shape)
        if s.nbytes != want:
            raise errors.SlotSizeMismatch(
                f"tensor {i} declares {s.nbytes} bytes; shape {list(s.shape)} {s.dtype} is {want}"
            )
    table = rules_for(header.codec_provider)
    base = _blocks(header, table)
    unruled = unruled_kinds(header.codec_provider)
    for i, e in enumerate(header.caches):
        _entry(e, table, unruled, len(header.tokens), f"cache {i}", base)
    if header.block is not None:
        _block(header)
    # last, so a header refused for what it says gets the same code from a file and from a spill
    if file_size is not None:
        fmt.check_layout(header, file_size)


# --- v2: a manifest's blocks, a block's own key ------------------------------------


def _blocks(header: fmt.Header, table: Mapping[str, KindRule] | None) -> int:
    """The token rows a manifest's blocks hold (0 for any other header): its positional caches store the rest."""
    b = header.blocks
    if b is None:
        return 0
    if header.block is not None:
        raise errors.BlockInvalid("a file is a manifest or a block, not both")
    if table is None:  # not a bad file: one this build cannot read (left alone, never quarantined)
        raise errors.CodecProviderMismatch(f"a manifest of codec provider {header.codec_provider!r}, unknown here")
    if not b.keys:
        raise errors.BlockInvalid("a manifest that names no blocks")
    if b.rows > len(header.tokens):
        raise errors.BlockInvalid(f"{len(b.keys)} blocks of {b.size} tokens, the file records {len(header.tokens)}")
    leaves = blocks.positional_leaves(header)
    if not leaves:
        raise errors.BlockInvalid("a manifest with blocks but no positional cache")
    # the key's layout names each tensor's rows and last dimension: checked here, before the codec rules run
    if any(len(s.shape) < 2 for e, _ in leaves for s in e.tensors):
        raise errors.TensorRankMismatch("a positional tensor of a manifest has fewer than 2 dimensions (rows, width)")
    # what its blocks hold is sized by its own tail's shapes (a tail of 0 rows names blocks of any width): bounded
    # as a file's tensors are, before anything is planned or fetched from it (found in review: blocks of 64 GiB)
    if (whole := blocks.cache_bytes(header)) > fmt.MAX_TOTAL_BYTES:
        raise errors.TotalSizeTooLarge(f"a manifest's cache of {whole} bytes exceeds {fmt.MAX_TOTAL_BYTES}")
    # its keys are the chain of its own tokens: a manifest cannot name blocks of another prefix (SHA-256 a block)
    if blocks.chain(blocks.header_root(header, b.size), header.tokens, b.size, len(b.keys)) != b.keys:
        raise errors.BlockKeyMismatch("the manifest's block keys are not the chain of its tokens and layout")
    return b.rows


def _block(header: fmt.Header) -> None:
    info = header.block
    assert info is not None
    size = len(header.tokens)
    if not fmt.MIN_BLOCK_TOKENS <= size <= fmt.MAX_BLOCK_TOKENS:
        raise errors.BlockInvalid(f"a block of {size} tokens (limits {fmt.MIN_BLOCK_TOKENS}..{fmt.MAX_BLOCK_TOKENS})")
    if header.attachments or header.checkpoint is not None or not header.caches:
        raise errors.BlockInvalid("a block holds positional caches only (no attachments, no checkpoint)")
    for i, e in enumerate(header.caches):
        if not blocks.is_positional(e, header.codec_provider) or e.offset != size:
            raise errors.BlockInvalid(f"block cache {i} ({e.kind}) is not {size} rows of a positional cache")
    if blocks.next_key(info.parent, header.tokens) != info.key:
        raise errors.BlockKeyMismatch("the block's key is not the hash of its parent and its tokens")
    if info.index == 0 and info.parent != blocks.header_root(header, size):
        raise errors.BlockKeyMismatch("block 0 does not chain from the root key of its identity and layout")


def _entry(
    e: fmt.CacheEntry,
    table: Mapping[str, KindRule] | None,
    unruled: frozenset[str],
    ntokens: int,
    where: str,
    base: int = 0,
) -> None:
    if e.offset is not None and ntokens and e.offset > ntokens:
        # A file saved without tokens (the mlx-lm prompt-cache drop-in) records none to compare with.
        raise errors.OffsetBeyondTokens(f"{where} ({e.kind}) encodes {e.offset} tokens, the file records {ntokens}")
    if table is not None and e.kind not in unruled:
        rule = table.get(e.kind)
        if rule is None:
            raise errors.KindNotInProvider(f"{where}: kind {e.kind!r} is not one of {sorted(table)}")
        _check_rule(e, rule, where, base if rule.rows is Rows.OFFSET and not e.children else 0)
    for j, c in enumerate(e.children):
        _entry(c, table, unruled, ntokens, f"{where}.{j}", base)


# --- one entry against its kind's rule --------------------------------------------


def _check_rule(e: fmt.CacheEntry, rule: KindRule, where: str, base: int = 0) -> None:
    """``base``: token rows held by a manifest's blocks (a positional cache stores the ones after them)."""
    where = f"{where} ({e.kind})"
    if e.version not in rule.reads:
        raise errors.CodecVersionUnsupported(f"{where}: codec version {e.version} (readable: {sorted(rule.reads)})")
    if e.children and not rule.children:
        raise errors.FieldInvalid(f"{where}: a {e.kind} entry has no children")
    f = _fields(e, rule, where)
    present = _tensors(e, rule, f, where)
    if base and not present:
        raise errors.TensorCountMismatch(
            f"{where}: a manifest's positional cache keeps its tensors (rows after the blocks)"
        )
    rows = _token_rows(present, where, empty_ok=base > 0) + base
    if rule.quantized and present:
        _quantization(present, f, where)
    if rule.batch:
        _batch(present, where)
    _relations(e, rule, f, rows, where)


def _fields(e: fmt.CacheEntry, rule: KindRule, where: str) -> dict[str, Any]:
    extra = sorted(map(repr, set(e.fields) - set(rule.fields)))  # keys may be str or bytes
    if extra:
        raise errors.FieldInvalid(f"{where}: unknown fields {extra}")
    out = {}
    for name, kind in rule.fields.items():
        if name not in e.fields:
            raise errors.FieldInvalid(f"{where}: field {name!r} missing")
        out[name] = _field_value(e.fields[name], kind, f"{where}.{name}")
    return out


def _field_value(v: Any, kind: FieldType, what: str) -> Any:
    if kind is FieldType.BOOL:
        if not isinstance(v, bool):
            raise errors.FieldInvalid(f"{what} must be a bool")
        return v
    if kind is FieldType.BOOL_LIST:
        if not isinstance(v, list) or len(v) > MAX_ARRAY_SLOTS or not all(isinstance(x, bool) for x in v):
            raise errors.FieldInvalid(f"{what} must be a list of at most {MAX_ARRAY_SLOTS} bools")
        return v
    lo = 1 if kind is FieldType.POSITIVE else 0
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= fmt.MAX_DIM:
        raise errors.FieldInvalid(f"{what} must be an int in [{lo}, {fmt.MAX_DIM}]")
    return v


def _tensors(e: fmt.CacheEntry, rule: KindRule, f: dict[str, Any], where: str) -> list[tuple[Tensor, fmt.Slot]]:
    if rule.tensors is None:  # a slot map decides (arrays): any rank, any dtype
        wanted = [_ANY] * (sum(f["slots"]) + f["left_padding"] + f["lengths"])
    else:
        wanted = [t for t in rule.tensors if t.flag is None or f[t.flag]]
        if rule.optional and not e.tensors:
            wanted = []
    if len(e.tensors) != len(wanted):
        raise errors.TensorCountMismatch(f"{where}: {len(e.tensors)} tensors, expected {len(wanted)}")
    for t, s in zip(wanted, e.tensors, strict=True):
        if t.rank is not None and len(s.shape) != t.rank:
            raise errors.TensorRankMismatch(f"{where}: {t.role} has rank {len(s.shape)}, expected {t.rank}")
        if t.dtypes is not None and s.dtype not in t.dtypes:
            raise errors.DtypeNotAllowed(f"{where}: {t.role} is {s.dtype}, expected one of {sorted(t.dtypes)}")
    return list(zip(wanted, e.tensors, strict=True))


def _token_rows(present: list[tuple[Tensor, fmt.Slot]], where: str, empty_ok: bool = False) -> int:
    """The rows every token tensor holds (0 for none); batch, heads and rows must agree."""
    shapes = [s.shape for t, s in present if t.token_axis]
    if not shapes:
        return 0
    if any(sh[:3] != shapes[0][:3] for sh in shapes):
        raise errors.ShapeMismatch(
            f"{where}: token tensors disagree on batch, heads or rows: {[list(s) for s in shapes]}"
        )
    # writers store an empty cache as no tensors (zero rows would size nothing they paid for); a manifest's
    # positional caches alone may hold none after their blocks
    if shapes[0][2] == 0 and not empty_ok:
        raise errors.ShapeMismatch(f"{where}: token tensors of shape {list(shapes[0])} hold no rows")
    return shapes[0][2]


def _quantization(present: list[tuple[Tensor, fmt.Slot]], f: dict[str, Any], where: str) -> None:
    bits, group = f["bits"], f["group_size"]
    if bits not in QUANT_BITS or group not in QUANT_GROUP_SIZES:
        raise errors.QuantizationInvalid(f"{where}: bits {bits}, group size {group}")
    slots = [s for _, s in present]
    for w, scales, biases in (slots[0:3], slots[3:6]):
        if scales.shape != biases.shape or scales.dtype != biases.dtype:
            raise errors.ShapeMismatch(f"{where}: scales {list(scales.shape)} and biases {list(biases.shape)} differ")
        # weights pack head_dim values of `bits` bits into u32 words; one scale per group
        if w.shape[-1] * 32 != scales.shape[-1] * group * bits:
            raise errors.ShapeMismatch(
                f"{where}: packed width {w.shape[-1]} does not hold {scales.shape[-1]} groups of {group} at {bits} bits"
            )


def _batch(present: list[tuple[Tensor, fmt.Slot]], where: str) -> None:
    sizes = {s.shape[0] for _, s in present}
    if len(sizes) > 1:
        raise errors.ShapeMismatch(f"{where}: tensors disagree on the batch size: {sorted(sizes)}")


def _relations(e: fmt.CacheEntry, rule: KindRule, f: dict[str, Any], rows: int, where: str) -> None:
    _offset_rule(e, rule, where)
    if rule.rows is not Rows.NONE:
        _rows_rule(e.offset or 0, rule.rows, f, rows, where)
    want_trim = {
        Trim.ALWAYS: True,
        Trim.NEVER: False,
        Trim.BELOW_MAX: (e.offset or 0) < f.get("max_size", 0),
        Trim.CHILDREN: all(c.trimmable for c in e.children),
    }[rule.trim]
    if e.trimmable != want_trim:
        raise errors.OffsetMismatch(f"{where}: trimmable is {e.trimmable}, its state says {want_trim}")
    want_min = {
        MinReusable.ZERO: 0,
        MinReusable.START: f.get("start_position", 0),
        MinReusable.CHILDREN: max((c.min_reusable for c in e.children), default=0),
    }[rule.min_reusable]
    if e.min_reusable != want_min:
        raise errors.OffsetMismatch(f"{where}: min_reusable {e.min_reusable}, its state says {want_min}")


def _offset_rule(e: fmt.CacheEntry, rule: KindRule, where: str) -> None:
    if rule.offset is Offset.TOKENS:
        ok = e.offset is not None
    elif rule.offset is Offset.NONE:
        ok = e.offset is None
    else:
        offsets = [c.offset for c in e.children if c.offset is not None]
        ok = e.offset == (max(offsets) if offsets else None)
    if not ok:
        raise errors.OffsetMismatch(f"{where}: offset {e.offset} breaks the {rule.offset.value} rule")


def _rows_rule(offset: int, how: Rows, f: dict[str, Any], rows: int, where: str) -> None:
    if how is Rows.OFFSET and rows != offset:
        raise errors.OffsetMismatch(f"{where}: offset {offset} but {rows} rows stored")
    if how is Rows.SINCE_START:
        start = f["start_position"]
        if start > offset or rows != offset - start:
            raise errors.OffsetMismatch(f"{where}: offset {offset}, start {start}, but {rows} rows stored")
    if how is Rows.BATCH:
        if offset != f["idx"]:
            raise errors.OffsetMismatch(f"{where}: offset {offset} but idx {f['idx']}")
        if rows != f["idx"]:
            raise errors.IndexOutOfRange(f"{where}: idx {f['idx']} but {rows} rows stored")
    if how in (Rows.RING, Rows.BATCH_RING):
        _ring(offset, how, f, rows, where)


def _ring(offset: int, how: Rows, f: dict[str, Any], rows: int, where: str) -> None:
    size = f["max_size"]
    if how is Rows.BATCH_RING and offset != f["pos"]:
        raise errors.OffsetMismatch(f"{where}: offset {offset} but pos {f['pos']}")
    if how is Rows.RING and f["keep"] > size:
        raise errors.FieldInvalid(f"{where}: keep {f['keep']} > max_size {size}")
    # the ring holds every token up to max_size, and never more rows than tokens
    if not min(offset, size) <= rows <= offset:
        raise errors.OffsetMismatch(f"{where}: offset {offset}, max_size {size}, but {rows} rows stored")
    if f["idx"] > rows:
        raise errors.IndexOutOfRange(f"{where}: idx {f['idx']} past the {rows} rows stored")
    # not wrapped yet, the ring writes at its end (mlx-lm's does): an idx inside it would let a cut load send the
    # ring's write index below zero, and the next token would be written nowhere
    if offset < size and f["idx"] != rows:
        raise errors.IndexOutOfRange(f"{where}: idx {f['idx']} inside a ring that has not wrapped ({rows} rows)")
    if how is Rows.RING:
        _wrapped_ring(f, rows, where)
    else:
        _batch_ring(offset, f, rows, where)


def _wrapped_ring(f: dict[str, Any], rows: int, where: str) -> None:
    """A ring as mlx-lm leaves it: written at its end (a prefill), or, full, past its ``keep`` sink rows (a decode
    step starts again after them): found in review, an idx at or below keep let the next step overwrite a sink row."""
    if f["idx"] != rows and not (rows == f["max_size"] and f["idx"] > f["keep"]):
        raise errors.IndexOutOfRange(f"{where}: idx {f['idx']} of a full ring of {rows} rows, keep {f['keep']}")


def _batch_ring(pos: int, f: dict[str, Any], rows: int, where: str) -> None:
    """mlx-lm's batch ring is ``rotated`` only once full (its write index went round), and written at its end until
    then: found in review, a flag set on a ring that never wrapped moved its padding mask onto real tokens."""
    size = f["max_size"]
    if f["rotated"] and (pos < size or rows != size):
        raise errors.FieldInvalid(f"{where}: rotated, but {rows} rows of a ring of {size} at pos {pos}")
    if not f["rotated"] and f["idx"] != rows:
        raise errors.IndexOutOfRange(f"{where}: idx {f['idx']} inside a ring not rotated ({rows} rows)")


def header_from_bytes(data: bytes | memoryview, file_size: int, path: str | None = None) -> fmt.Header:
    """The checked header of a file whose first bytes (at least its prefix and header) are ``data``: prefix,
    header, padding and every rule here. A file fetched from another tier is read with this before it is kept."""
    raw = memoryview(data)
    prefix = fmt.decode_prefix(bytes(raw[: fmt.PREFIX_LEN]), file_size, path)
    if len(raw) < prefix.data_start:
        raise errors.TruncatedFile("file ended inside the header", path=path)
    header_end = fmt.PREFIX_LEN + prefix.header_len
    header = fmt.decode_header(bytes(raw[fmt.PREFIX_LEN : header_end]), prefix, file_size, path)
    validate_header(header, file_size, prefix_version=prefix.version, path=path)
    fmt.check_padding(bytes(raw[header_end : prefix.data_start]), path)
    return header


def check_file_bytes(data: bytes | memoryview, path: str | None = None) -> fmt.Header:
    """A whole file held in memory, checked as a reader checks it: prefix, header, every rule here, and every
    tensor's hash (a file fetched from another tier, before a byte of it is written)."""
    raw = memoryview(data)
    header = header_from_bytes(raw, raw.nbytes, path)
    for i, s in enumerate(header.slots()):
        at = header.data_start + s.off
        if fmt.xxh3(raw[at : at + s.nbytes]) != s.hash:
            raise errors.TensorHashMismatch(f"tensor {i} at offset {s.off} does not match its hash", path=path)
    return header
