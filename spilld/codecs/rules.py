"""What every codec of a provider promises about its entries, stated as data.

Pure: no mlx, no mlx-lm, no I/O, so the daemon can check a spill's header
without importing an engine. ``spilld.validate`` reads these tables; each
codec points at its own rule (``Codec.rules``) and a test checks that the
two agree with mlx-lm (step sizes, classes).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from .. import format as fmt

MLX_LM_PROVIDER_ID = "spilld/mlx-lm/1"

# mlx-lm's KVCache.step (and that of every cache class that grows): the rows a
# load may add past the stored ones so the next decode step appends in place.
CAPACITY_STEP = 256
GROWTH_MAX_BYTES = 1024 * 1024  # a capacity step adds at most this, or the tensor's own bytes if more


def growth_allowed(slot: fmt.Slot, capacity: int) -> bool:
    """Whether a load may give ``slot`` ``capacity`` rows (axis -2): at most one step past the rows it holds, within
    ``fmt.MAX_DIM``, adding at most ``GROWTH_MAX_BYTES`` or the tensor's own bytes, whichever is more (found in
    review: a hostile file of one wide row asked for 64 GiB before any hash was read)."""
    shape = slot.shape
    if len(shape) < 2 or shape[-2] == 0 or not shape[-2] < capacity <= min(shape[-2] + CAPACITY_STEP, fmt.MAX_DIM):
        return False
    return (capacity - shape[-2]) * (slot.nbytes // shape[-2]) <= max(slot.nbytes, GROWTH_MAX_BYTES)


FLOATS = frozenset({"float16", "bfloat16", "float32"})
INDEX = frozenset({"int32"})  # per-sequence offsets and paddings (mx.array of Python ints)
PACKED = frozenset({"uint32"})  # quantized weights
QUANT_BITS = frozenset({2, 3, 4, 5, 6, 8})
QUANT_GROUP_SIZES = frozenset({32, 64, 128})
MAX_ARRAY_SLOTS = 65_536  # ArraysCache slots (present or not): the list is allocated as given


class Rows(StrEnum):
    """How the rows (axis -2) of an entry's token tensors relate to its offset and fields."""

    OFFSET = "offset"  # rows == offset
    SINCE_START = "since_start"  # rows == offset - start_position
    RING = "ring"  # min(offset, max_size) <= rows <= offset, idx <= rows
    BATCH = "batch"  # rows == idx == offset
    BATCH_RING = "batch_ring"  # as RING with pos as the offset
    NONE = "none"  # no token axis (recurrent state)


class Offset(StrEnum):
    TOKENS = "tokens"  # an int: tokens this cache encodes
    NONE = "none"  # always nil
    CHILDREN = "children"  # max of the children's non-nil offsets, else nil


class Trim(StrEnum):
    ALWAYS = "always"
    NEVER = "never"
    BELOW_MAX = "below_max"  # offset < max_size (a ring that has not wrapped)
    CHILDREN = "children"  # every child trimmable


class MinReusable(StrEnum):
    ZERO = "zero"
    START = "start"  # == start_position
    CHILDREN = "children"  # max over the children


class FieldType(StrEnum):
    INT = "int"  # 0 <= v <= MAX_DIM
    POSITIVE = "positive"  # 1 <= v <= MAX_DIM
    BOOL = "bool"
    BOOL_LIST = "bool_list"  # at most MAX_ARRAY_SLOTS


@dataclass(frozen=True)
class Tensor:
    """One tensor of an entry: its role, rank (None: any), dtypes (None: any) and presence flag."""

    role: str
    rank: int | None
    dtypes: frozenset[str] | None
    flag: str | None = None  # present only when this bool field is true
    token_axis: bool = False  # axis -2 holds the entry's rows


@dataclass(frozen=True)
class KindRule:
    """The rules of one codec kind. ``tensors`` is None where a slot map field decides (``arrays``)."""

    kind: str
    reads: frozenset[int]
    fields: Mapping[str, FieldType]
    tensors: tuple[Tensor, ...] | None
    optional: bool  # the unflagged tensors are all-or-none (an empty cache stores none)
    rows: Rows
    offset: Offset
    trim: Trim
    min_reusable: MinReusable
    quantized: bool = False  # (weights, scales, biases) triples, consistent with bits and group_size
    children: bool = False
    batch: bool = False  # every tensor's axis 0 is the batch size
    step: int | None = None  # capacity step on load (None: loaded at its stored size)
    # a field whose multiples a cut may end on at or above ``min_reusable`` (chunked attention: a token attends from
    # the start of its chunk, so a cut below the chunk boundary past ``start_position`` lacks rows it needs)
    cut_step: str | None = None


def _kv(role: str, flag: str | None = None) -> Tensor:
    return Tensor(role, 4, FLOATS, flag, token_axis=True)


def _vec(role: str, flag: str | None = None) -> Tensor:
    return Tensor(role, 1, INDEX, flag)


_KV = (_kv("keys"), _kv("values"))
_QUANT = tuple(
    Tensor(f"{side}.{part}", 4, PACKED if part == "weights" else FLOATS, token_axis=True)
    for side in ("keys", "values")
    for part in ("weights", "scales", "biases")
)
_ONE = frozenset({1})

MLX_LM_RULES: Mapping[str, KindRule] = {
    r.kind: r
    for r in [
        KindRule(
            "kv", _ONE, {}, _KV, True, Rows.OFFSET, Offset.TOKENS, Trim.ALWAYS, MinReusable.ZERO, step=CAPACITY_STEP
        ),
        KindRule("concat", _ONE, {}, _KV, True, Rows.OFFSET, Offset.TOKENS, Trim.ALWAYS, MinReusable.ZERO),
        KindRule(
            "chunked",
            _ONE,
            {"chunk_size": FieldType.POSITIVE, "start_position": FieldType.INT},
            _KV,
            True,
            Rows.SINCE_START,
            Offset.TOKENS,
            Trim.ALWAYS,
            MinReusable.START,
            step=CAPACITY_STEP,
            cut_step="chunk_size",
        ),
        KindRule(
            "rotating",
            _ONE,
            {"keep": FieldType.INT, "max_size": FieldType.POSITIVE, "idx": FieldType.INT},
            _KV,
            True,
            Rows.RING,
            Offset.TOKENS,
            Trim.BELOW_MAX,
            MinReusable.ZERO,
        ),
        KindRule(
            "quantized",
            _ONE,
            {"group_size": FieldType.POSITIVE, "bits": FieldType.POSITIVE},
            _QUANT,
            True,
            Rows.OFFSET,
            Offset.TOKENS,
            Trim.ALWAYS,
            MinReusable.ZERO,
            quantized=True,
            step=CAPACITY_STEP,
        ),
        KindRule(
            "arrays",
            _ONE,
            {"slots": FieldType.BOOL_LIST, "left_padding": FieldType.BOOL, "lengths": FieldType.BOOL},
            None,
            False,
            Rows.NONE,
            Offset.NONE,
            Trim.NEVER,
            MinReusable.ZERO,
        ),
        KindRule(
            "list", _ONE, {}, (), False, Rows.NONE, Offset.CHILDREN, Trim.CHILDREN, MinReusable.CHILDREN, children=True
        ),
        KindRule(
            "batch_kv",
            _ONE,
            {"idx": FieldType.INT, "has_kv": FieldType.BOOL, "right_padding": FieldType.BOOL},
            (
                _vec("offset"),
                _vec("left_padding"),
                _kv("keys", "has_kv"),
                _kv("values", "has_kv"),
                _vec("right_padding", "right_padding"),
            ),
            False,
            Rows.BATCH,
            Offset.TOKENS,
            Trim.ALWAYS,
            MinReusable.ZERO,
            batch=True,
            step=CAPACITY_STEP,
        ),
        KindRule(
            "batch_rotating",
            _ONE,
            {
                "max_size": FieldType.POSITIVE,
                "pos": FieldType.INT,
                "idx": FieldType.INT,
                "rotated": FieldType.BOOL,
                "has_kv": FieldType.BOOL,
                "lengths": FieldType.BOOL,
            },
            (
                _vec("offset"),
                _vec("left_padding"),
                _kv("keys", "has_kv"),
                _kv("values", "has_kv"),
                _vec("lengths", "lengths"),
            ),
            False,
            Rows.BATCH_RING,
            Offset.TOKENS,
            Trim.BELOW_MAX,
            MinReusable.ZERO,
            batch=True,
        ),
    ]
}

# Rule tables by codec provider id. A provider's id names a fixed set of kinds:
# a kind outside its table makes the file bad, not newer (new kinds need a new id).
PROVIDER_RULES: dict[str, Mapping[str, KindRule]] = {MLX_LM_PROVIDER_ID: MLX_LM_RULES}
# kinds a provider registered without a rule (an engine's own cache classes): its codec checks them itself
_UNRULED: dict[str, frozenset[str]] = {}
_REGISTERING = threading.Lock()


def cut_floor(header: fmt.Header) -> int:
    """The fewest tokens ``header``'s caches may be cut back to: the largest ``min_reusable``, each rounded up to its
    kind's ``cut_step`` (found in review: a Llama 4 chunked cache cut between its ``start_position`` and the next
    chunk boundary was served, and its next logits were wrong). A provider unknown here: ``min_reusable`` alone."""
    table = rules_for(header.codec_provider)
    return max((_floor(e, table) for e in header.caches), default=0)


def _floor(e: fmt.CacheEntry, table: Mapping[str, KindRule] | None) -> int:
    rule = table.get(e.kind) if table is not None else None
    floor = max([e.min_reusable, *(_floor(c, table) for c in e.children)])
    step = e.fields.get(rule.cut_step) if rule is not None and rule.cut_step is not None else None
    if type(step) is int and step > 0 and floor % step:
        floor = min(-(-floor // step) * step, e.offset if e.offset is not None else floor)
    return floor


def rules_for(provider_id: str) -> Mapping[str, KindRule] | None:
    """The rule table of a provider id, or None for a provider this process does not know."""
    return PROVIDER_RULES.get(provider_id)


def unruled_kinds(provider_id: str) -> frozenset[str]:
    """The kinds of a known provider that have no rule (taken as they are; any other kind not in its table is
    refused)."""
    return _UNRULED.get(provider_id, frozenset())


def register_rules(provider_id: str, table: Mapping[str, KindRule], unruled: frozenset[str] = frozenset()) -> None:
    """Make a provider's rules known to this process's readers (each ``CodecProvider`` registers its codecs' rules,
    so its built-in kinds keep theirs, found in review: they were skipped)."""
    with _REGISTERING:
        known = PROVIDER_RULES.get(provider_id)
        if known is not None and (dict(known), _UNRULED.get(provider_id, frozenset())) != (dict(table), unruled):
            # files name their table by id: two tables under one id would make one's files the other's (review)
            raise ValueError(f"codec provider {provider_id!r} is registered already, with other codecs")
        _UNRULED[provider_id] = unruled  # first: a reader that finds the table finds its unruled kinds
        PROVIDER_RULES[provider_id] = dict(table)
