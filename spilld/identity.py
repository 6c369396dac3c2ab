"""Identity fields for a model: which files it may load.

The config fingerprint covers everything that shapes the KV tensors (the
model's arguments, its dtype and the KV quantization); the tokenizer hash
covers the vocabulary, so identical ids mean identical text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import xxhash

from .format import Identity


def _jsonable(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def _model_dtype(model: Any) -> str:
    try:
        from mlx.utils import tree_flatten

        leaves: Any = tree_flatten(model.parameters())
        for _, p in leaves:
            return str(p.dtype).removeprefix("mlx.core.")
    except Exception:  # a model without parameters() still gets a fingerprint
        pass
    return "unknown"


def config_fingerprint(model: Any, *, kv_bits: int | None = None, kv_group_size: int | None = None) -> str:
    """First 16 hex digits of sha256 over the model's arguments, dtype and KV quantization."""
    args = getattr(model, "args", None)
    payload = {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "args": _jsonable(args) if args is not None else None,
        "dtype": _model_dtype(model),
        "kv_bits": kv_bits,
        "kv_group_size": kv_group_size if kv_bits else None,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tokenizer_hash(tokenizer: Any) -> str:
    """xxh3-128 hex of the vocabulary (token -> id), sorted, plus the added tokens."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else dict(tok)
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def identity(
    model: Any,
    tokenizer: Any = None,
    *,
    model_id: str = "",
    namespace: str = "",
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
) -> Identity:
    """The identity fields for an mlx-lm model (and tokenizer, when given)."""
    return Identity(
        model_id=model_id,
        config_fingerprint=config_fingerprint(model, kv_bits=kv_bits, kv_group_size=kv_group_size),
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else "",
        namespace=namespace,
    )
