"""Drop-ins for mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``.

Same signatures and results (string metadata round-trips; no tokens are stored). Saves write spilld's format
(hashed, atomic, durable), and never under a ``.safetensors`` name, which promises a format no safetensors tool
could read: a name ending in ``.safetensors`` (mlx-lm's documented name) is saved with spilld's extension
instead (``prompt.safetensors`` -> ``prompt.spilld``). Loads read both formats: a spilld file (by its magic
bytes) with spilld's verified loader, anything else through mlx-lm's own ``load_prompt_cache``. A save under
a ``.safetensors`` name removes the file of that name (a save replaces what the name held, as mlx-lm's does), so
when a name and its spilld twin both exist, the name was written later: it is read unless its twin is newer.
"""

from __future__ import annotations

import os
from typing import Any

from . import format as fmt
from .loader import load
from .saver import save

SAFETENSORS_EXT = ".safetensors"
SPILLD_EXT = ".spilld"  # the store's extension too


def spilld_name(file_name: str | os.PathLike[str]) -> str:
    """Where ``save_prompt_cache(file_name, ...)`` writes: ``.safetensors`` becomes ``.spilld``, any other name
    is kept as it is."""
    name = os.fspath(file_name)
    if name.endswith(SAFETENSORS_EXT):
        return name[: -len(SAFETENSORS_EXT)] + SPILLD_EXT
    return name


def save_prompt_cache(
    file_name: str | os.PathLike[str], cache: list[Any], metadata: dict[str, str] | None = None
) -> str:
    """Save a prompt cache in spilld's format; returns the path written (``spilld_name(file_name)``). A regular
    file under ``file_name`` itself, when that is not the path written, is removed once the save is durable."""
    path, name = spilld_name(file_name), os.fspath(file_name)
    save(path, [], cache, metadata)
    if name != path and os.path.isfile(name) and not os.path.islink(name):
        # an older save under the name (mlx-lm's): a load must not find it later on an mtime tie (found in review)
        os.unlink(name)
    return path


def _is_spilld(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(fmt.MAGIC)) == fmt.MAGIC


def _source(file_name: str | os.PathLike[str]) -> str:
    """The file a load reads: the name given, or its spilld twin when that one was written later."""
    name, twin = os.fspath(file_name), spilld_name(file_name)
    if twin == name or not os.path.exists(twin):
        return name
    if not os.path.exists(name) or os.stat(twin).st_mtime_ns > os.stat(name).st_mtime_ns:
        return twin
    return name


def load_prompt_cache(file_name: str | os.PathLike[str], return_metadata: bool = False) -> Any:
    """Load a prompt cache written by this module or by mlx-lm; with ``return_metadata`` also the metadata."""
    path = _source(file_name)
    if not _is_spilld(path):
        from mlx_lm.models import cache as mlx_lm_cache  # not ours: mlx-lm reads its own files

        mlx_lm_load: Any = mlx_lm_cache.load_prompt_cache  # mlx-lm's functions carry no annotations
        return mlx_lm_load(path, return_metadata=return_metadata)
    loaded = load(path)
    if return_metadata:
        return loaded.caches, dict(loaded.meta)
    return loaded.caches
