"""Drop-ins for mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``.

Same signatures and behaviour (string metadata round-trips; no tokens are
stored), but the file is spilld's format: hashed, atomic and durable.
"""

from __future__ import annotations

import os
from typing import Any

from .loader import load
from .saver import save


def save_prompt_cache(
    file_name: str | os.PathLike[str], cache: list[Any], metadata: dict[str, str] | None = None
) -> None:
    """Save a prompt cache to exactly ``file_name`` (no extension is added)."""
    save(file_name, [], cache, metadata)


def load_prompt_cache(file_name: str | os.PathLike[str], return_metadata: bool = False) -> Any:
    """Load a prompt cache; with ``return_metadata`` also the metadata dict."""
    loaded = load(file_name)
    if return_metadata:
        return loaded.caches, dict(loaded.meta)
    return loaded.caches
