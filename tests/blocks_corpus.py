"""Caches and files for the prefix-block tests (tests/test_blocks.py).

Two kinds of caches. ``conversation`` builds caches without a model whose rows are a pure function of the token
prefix, as a real model's are (row i is drawn from a seed chained over tokens ``[0, i]``): two conversations that
share a prefix share its rows bit for bit, so blocks written by one are right for the other. ``prefill`` runs a
tiny random-weight model (tests/models.py) for the tests that compare next-step logits; a prefix is always fed
alone first, then the rest, so two conversations that share it hold the very same rows for it.

Hostile files are made from real ones with the format's own functions (tests/hostile.py: ``split`` and ``join``),
so only the edited field is wrong: the header hash is right, the data region untouched.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as C
from mlx_lm.models.cache import make_prompt_cache

from spilld import format as fmt
from spilld.blocks import BLOCK_EXT
from spilld.store import EXT, QUARANTINE
from tests.hostile import join, split
from tests.models import MODELS, cache_arrays, tiny_llama

B = 16  # the block size of every store here (the smallest a store takes): caches stay small
_MASK = (1 << 61) - 1


# --- caches whose rows are a pure function of the prefix ----------------------------------------


def prefix_rows(tokens: list[int], *, heads: int = 2, dim: int = 8, salt: int = 0) -> tuple[mx.array, mx.array]:
    """Keys and values ``(1, heads, len(tokens), dim)``: row i depends on ``tokens[: i + 1]`` (and ``salt``) only."""
    h, rows = salt + 1, []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & _MASK
        rows.append(np.random.default_rng(h).standard_normal((2, heads, dim), dtype=np.float32))
    arr = np.stack(rows, axis=2) if rows else np.zeros((2, heads, 0, dim), np.float32)
    return mx.array(arr[0][None]), mx.array(arr[1][None])


def _feed(cache: Any, tokens: list[int], salt: int, dim: int = 8) -> Any:
    """Rows fed as an engine does: a prefill, then the last three tokens one step at a time."""
    k, v = prefix_rows(tokens, dim=dim, salt=salt)
    cut = max(len(tokens) - 3, 1)
    cache.update_and_fetch(k[..., :cut, :], v[..., :cut, :])
    for i in range(cut, len(tokens)):
        cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    return cache


def _state(tokens: list[int], salt: int) -> C.ArraysCache:
    """A recurrent state: a function of every token (not of position), never cut into blocks."""
    seed = (hash(tuple(tokens)) + salt) & _MASK
    rng = np.random.default_rng(seed)
    c = C.ArraysCache(2)
    c[0] = mx.array(rng.standard_normal((1, 3, 16), dtype=np.float32))
    c[1] = mx.array(rng.standard_normal((1, 2, 8, 8), dtype=np.float32))
    return c


def layer(kind: str, tokens: list[int], salt: int = 0) -> Any:
    """One layer's cache of ``kind`` holding ``tokens``."""
    if kind == "kv":
        return _feed(C.KVCache(), tokens, salt)
    if kind == "quantized":
        return _feed(C.QuantizedKVCache(group_size=32, bits=8), tokens, salt, dim=32)
    if kind == "concat":
        return _feed(C.ConcatenateKVCache(), tokens, salt)
    if kind == "list":  # a CacheList of positional caches: its children are cut into blocks
        return C.CacheList(_feed(C.KVCache(), tokens, salt), _feed(C.KVCache(), tokens, salt + 100))
    if kind == "hybrid_list":  # a CacheList of a recurrent state and a KV cache (Falcon-H1's layout)
        return C.CacheList(_state(tokens, salt), _feed(C.KVCache(), tokens, salt + 100))
    if kind == "rotating":
        return _feed(C.RotatingKVCache(max_size=8, keep=2), tokens, salt)
    if kind == "arrays":
        return _state(tokens, salt)
    if kind == "chunked":
        return _feed(C.ChunkedKVCache(chunk_size=8), tokens, salt)
    raise ValueError(kind)


def conversation(tokens: list[int], kinds: tuple[str, ...] = ("kv", "kv")) -> list[Any]:
    """The caches of a model with these layers after ``tokens``."""
    caches = [layer(k, tokens, salt=i) for i, k in enumerate(kinds)]
    mx.eval(cache_arrays(caches))
    return caches


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# --- tiny models, one per cache class ----------------------------------------------------------


def _quantized(model: nn.Module) -> list[Any]:
    return [C.QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]


def _concat(model: nn.Module) -> list[Any]:
    return [C.ConcatenateKVCache() for _ in model.layers]


# class -> (model builder, cache factory, whether every cache is positional: its blocks alone restore a prefix)
ModelCase = tuple[Callable[[], nn.Module], Callable[[nn.Module], list[Any]], bool]
MODEL_CASES: dict[str, ModelCase] = {
    "KVCache": (tiny_llama, make_prompt_cache, True),
    "QuantizedKVCache": (lambda: tiny_llama(hidden=128), _quantized, True),  # head dim 32: one group of 32
    "ConcatenateKVCache": (tiny_llama, _concat, True),
    "RotatingKVCache": (MODELS["gemma3"], make_prompt_cache, False),  # beside a KVCache layer
    "ArraysCache": (MODELS["mamba2"], make_prompt_cache, False),
    "CacheList": (MODELS["falcon_h1"], make_prompt_cache, False),  # CacheList(ArraysCache, KVCache)
    "ChunkedKVCache": (MODELS["llama4"], make_prompt_cache, False),  # beside a KVCache layer
}


def prefill(model: nn.Module, factory: Callable[[nn.Module], list[Any]], *parts: list[int]) -> list[Any]:
    """A fresh cache fed ``parts`` one after the other (a shared prefix first, so its rows are the same bits)."""
    cache = factory(model)
    for p in parts:
        out = model(mx.array(p)[None], cache=cache)
        mx.eval(out, cache_arrays(cache))
    return cache


# --- files ----------------------------------------------------------------------------------------


def files(root: str, ext: str) -> list[str]:
    """Every file of ``ext`` under the root, quarantine excluded, sorted."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != QUARANTINE]
        out += [os.path.join(folder, n) for n in names if n.endswith(ext)]
    return sorted(out)


def blocks_on_disk(root: str) -> list[str]:
    return files(root, BLOCK_EXT)


def manifests_on_disk(root: str) -> list[str]:
    return files(root, EXT)


def disk_bytes(root: str) -> int:
    """Bytes of every entry and block file (what the disk cap counts)."""
    return sum(os.path.getsize(p) for p in [*blocks_on_disk(root), *manifests_on_disk(root)])


def quarantined(root: str) -> list[str]:
    q = os.path.join(root, QUARANTINE)
    return sorted(os.listdir(q)) if os.path.isdir(q) else []


def key_of(block_path: str) -> bytes:
    return bytes.fromhex(os.path.basename(block_path).split("-", 1)[0])


def rewrite(path: str, edit: Callable[[dict[str, Any]], None], dest: str | None = None, version: int = 0) -> str:
    """The file at ``path`` with its header map edited (its hash made right again), written to ``dest``."""
    with open(path, "rb") as f:
        wire, body = split(f.read())
    edit(wire)
    out = dest or path
    with open(out, "wb") as f:
        f.write(join(wire, body, version or fmt.FORMAT_VERSION))
    return out


def _wire_slots(wire: dict[str, Any]) -> list[dict[str, Any]]:
    def walk(e: dict[str, Any]) -> list[dict[str, Any]]:
        return [*e["tensors"], *(s for c in e["children"] for s in walk(c))]

    return [*(s for e in wire["caches"] for s in walk(e)), *(s for a in wire["attachments"] for s in a["tensors"])]


def as_version(path: str, dest: str, version: int) -> str:
    """The file at ``path`` (this build's) as a file of an older ``version`` would hold it: no ``align`` and its
    tensors moved to page-aligned offsets (this build packs a small file); in v1 no blocks either."""
    with open(path, "rb") as f:
        wire, body = split(f.read())
    del wire["align"]
    if version < 2:
        assert wire["blocks"] is None and wire["block"] is None
        del wire["blocks"], wire["block"]
    wire["format"] = version
    out = bytearray()
    for s in _wire_slots(wire):
        at, s["off"] = s["off"], fmt.align_up(len(out))
        if s["bytes"]:  # a zero-byte tensor never extends the file
            out += bytes(s["off"] - len(out)) + body[at : at + s["bytes"]]
    with open(dest, "wb") as f:
        f.write(join(wire, bytes(out), version))
    return dest


def as_v1(path: str, dest: str) -> str:
    """A v1 file of an entry written whole (no blocks): what a store of spilld 0.1 holds."""
    return as_version(path, dest, 1)


def copy_to(src: str, folder: str, name: str | None = None) -> str:
    os.makedirs(folder, exist_ok=True)
    return shutil.copyfile(src, os.path.join(folder, name or os.path.basename(src)))


def entry_name() -> str:
    """A fresh entry file name, as the store makes them."""
    return secrets.token_hex(12) + EXT
