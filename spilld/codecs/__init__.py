"""Cache codecs: one per cache class, chosen through an explicit registry."""

from .base import Codec, DecodeContext, EncodeContext, Encoded, view
from .registry import MLX_LM_PROVIDER_ID, CodecProvider, default_provider

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
