"""What a spill takes on the engine's thread: token ids, zero-copy clones of its caches and attachments, evaluated.

Each function here but ``token_list`` runs where the engine's arrays live (only that thread can evaluate their
graphs); what they return can be written later, on any thread. ``token_list`` checks the ids later, off that thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import errors
from .. import format as fmt
from ..codecs import CodecProvider, default_provider

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass
class Attachment:
    """Companion state saved beside the caches (e.g. a draft model's KV); never trimmed."""

    schema: str
    metadata: dict[str, str | int | float | bool] = field(default_factory=dict)
    tensors: list[mx.array] = field(default_factory=list)


def token_list(tokens: Any) -> list[int]:
    """Token ids from a list, numpy array or mlx array, checked to fit in u32 (vectorized: it runs on the engine thread)."""
    if tokens is None:
        return []
    import mlx.core as mx

    try:
        arr = np.asarray(tokens.tolist() if isinstance(tokens, mx.array) else tokens)
    except (TypeError, ValueError):  # a ragged list, or ints too large for any numpy type
        raise errors.BadParams("token ids must be a flat sequence of integers") from None
    if arr.size == 0:
        return []
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise errors.BadParams("token ids must be a flat sequence of integers")
    if int(arr.min()) < 0 or int(arr.max()) >= 2**32:
        raise errors.BadParams("token ids must fit in an unsigned 32-bit integer")
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

    from ..codecs.base import view

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
