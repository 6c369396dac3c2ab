"""Cache codecs: one per cache class, chosen through an explicit registry.

The codecs import mlx and mlx-lm; ``spilld.codecs.rules`` (what each codec
promises, as data) does not, so this package loads its codecs lazily and the
daemon can read the rules without an engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Codec, DecodeContext, EncodeContext, Encoded, view
    from .registry import CodecProvider, default_provider
    from .rules import MLX_LM_PROVIDER_ID

_LAZY = {
    "Codec": "base",
    "DecodeContext": "base",
    "EncodeContext": "base",
    "Encoded": "base",
    "view": "base",
    "CodecProvider": "registry",
    "default_provider": "registry",
    "MLX_LM_PROVIDER_ID": "rules",
}

__all__ = [
    "MLX_LM_PROVIDER_ID",
    "Codec",
    "CodecProvider",
    "DecodeContext",
    "EncodeContext",
    "Encoded",
    "default_provider",
    "view",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
