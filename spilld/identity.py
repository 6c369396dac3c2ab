"""Identity fields for a model: which files it may load.

The model fingerprint (the ``config_fingerprint`` field) covers everything that decides what a KV cache means:
the model's class and arguments, its dtype, the KV quantization, and its weights, adapters included. Two
fine-tunes of one base model, a LoRA adapter, or a model repo updated in place get other fingerprints, so they
never restore each other's caches; ``model_id`` is a label for people, not the guard. The tokenizer hash covers
the vocabulary, so identical ids mean identical text.

Weights are fingerprinted from their files when a path is given (each safetensors header: names, shapes,
dtypes and offsets; plus the bytes of ``SAMPLE_WINDOWS`` windows spread over the data; computed once and cached
by path, size and mtime), else from the model's parameters in memory (names, shapes, dtypes, small tensors
whole and a few windows of each large one). A change confined to bytes no window covers is not seen; a
fine-tune, an adapter or a new revision changes far more than that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterable
from typing import Any, cast

import xxhash

from . import errors
from .format import Identity

SAMPLE_WINDOW_BYTES = 4096  # one sampled window of weight bytes
SAMPLE_WINDOWS = 64  # windows per weights file
PARAM_WINDOWS = 4  # windows per large in-memory parameter
PARAM_WHOLE_BYTES = 64 * 1024  # in-memory parameters up to this size are hashed whole
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # a header declaring more is not a safetensors file
CONFIG_FILES = ("config.json", "adapter_config.json")

# (real path, size, mtime_ns) -> digest: a model folder is read once per process, again only if a file changes
CONFIG_READ_CHUNK = 1 << 20  # a config file is hashed this many bytes a read
_file_digests: dict[tuple[str, int, int], str] = {}


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


def _parameters(model: Any) -> list[tuple[str, Any]]:
    """The model's parameters as (dotted name, array), sorted; empty for an object without ``parameters()``."""
    if not hasattr(model, "parameters"):
        return []
    from mlx.utils import tree_flatten  # engine side only: the daemon never fingerprints a model

    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sorted(flat, key=lambda kv: kv[0])


def _model_dtype(model: Any) -> str:
    for _, p in _parameters(model):
        return str(p.dtype).removeprefix("mlx.core.")
    return "unknown"


def _windows(size: int, count: int) -> list[tuple[int, int]]:
    """``count`` windows of at most SAMPLE_WINDOW_BYTES spread evenly over ``size`` bytes (first and last included)."""
    if size <= count * SAMPLE_WINDOW_BYTES:
        return [(0, size)]
    step = (size - SAMPLE_WINDOW_BYTES) / (count - 1)
    return [(round(i * step), SAMPLE_WINDOW_BYTES) for i in range(count)]


def parameters_fingerprint(model: Any) -> str:
    """xxh3-128 hex over the in-memory parameters: names, shapes, dtypes and sampled bytes."""
    import mlx.core as mx

    h = xxhash.xxh3_128()
    for name, p in _parameters(model):
        h.update(json.dumps([name, list(p.shape), str(p.dtype), p.nbytes]).encode())
        mv = memoryview(cast(Any, p))  # evaluates a lazy parameter on this (the engine's) thread
        if not mv.c_contiguous:
            p = mx.contiguous(p)
            mx.eval(p)
            mv = memoryview(cast(Any, p))
        raw = mv.cast("B")
        spans = [(0, raw.nbytes)] if raw.nbytes <= PARAM_WHOLE_BYTES else _windows(raw.nbytes, PARAM_WINDOWS)
        for start, n in spans:
            h.update(raw[start : start + n])
    return h.hexdigest()


def _safetensors_header(fd: int, size: int, path: str) -> tuple[bytes, int]:
    """A safetensors file's JSON header and where its data starts."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise errors.FileFormatError("not a safetensors file (shorter than its length field)", path=path)
    (n,) = struct.unpack("<Q", head)
    if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
        raise errors.FileFormatError(f"not a safetensors file (header length {n})", path=path)
    return os.pread(fd, n, 8), 8 + n


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """xxh3-128 hex of one weights or config file (a safetensors file: its header and sampled data windows).

    Cached by real path, size and mtime: a model's files are read once per process.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    if key in _file_digests:
        return _file_digests[key]
    h = xxhash.xxh3_128()
    h.update(struct.pack("<Q", st.st_size))
    fd = os.open(real, os.O_RDONLY)
    try:
        if real.endswith(".safetensors"):
            header, start = _safetensors_header(fd, st.st_size, real)
            h.update(header)
            for off, n in _windows(st.st_size - start, SAMPLE_WINDOWS):
                h.update(os.pread(fd, n, start + off))
        else:  # a config: small, read whole, in chunks (its size is the file's to say, not ours to allocate)
            for off in range(0, st.st_size, CONFIG_READ_CHUNK):
                h.update(os.pread(fd, min(CONFIG_READ_CHUNK, st.st_size - off), off))
    finally:
        os.close(fd)
    digest = h.hexdigest()
    _file_digests[key] = digest
    return digest


def _weight_files(path: str | os.PathLike[str]) -> list[str]:
    p = os.fspath(path)
    if not os.path.isdir(p):
        return [p]
    names = sorted(n for n in os.listdir(p) if n.endswith(".safetensors") or n in CONFIG_FILES)
    if not any(n.endswith(".safetensors") for n in names):
        raise errors.FileFormatError("no .safetensors file in the model folder", path=p)
    return [os.path.join(p, n) for n in names]


def files_fingerprint(paths: Iterable[str | os.PathLike[str]]) -> str:
    """xxh3-128 hex over model or adapter folders (or files): each file's name and fingerprint."""
    h = xxhash.xxh3_128()
    for path in paths:
        for f in _weight_files(path):
            h.update(json.dumps([os.path.basename(f), file_fingerprint(f)]).encode())
    return h.hexdigest()


def weights_fingerprint(
    model: Any, *, weights: str | os.PathLike[str] | None = None, adapter: str | os.PathLike[str] | None = None
) -> str:
    """The weights part of the fingerprint: from files when ``weights`` is given, else from memory.

    In memory, an adapter applied to the model (LoRA layers) is among its parameters; ``adapter`` adds its files.
    """
    parts = [files_fingerprint([weights]) if weights is not None else parameters_fingerprint(model)]
    if adapter is not None:
        parts.append(files_fingerprint([adapter]))
    return ":".join(parts)


def config_fingerprint(
    model: Any,
    *,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    weights: str | os.PathLike[str] | None = None,
    adapter: str | os.PathLike[str] | None = None,
    max_kv_size: int | None = None,
    quantized_kv_start: int | None = None,
) -> str:
    """First 16 hex digits of sha256 over the model's class, arguments, dtype, KV quantization, the engine's cache
    settings (a window, and where quantization starts: found in review, an engine without a window was served
    another's 64-token window) and weights. A setting left None is not hashed: identities made before it existed
    keep their value."""
    args = getattr(model, "args", None)
    if args is None:  # some families keep it as ``config`` (youtu_llm, plamo2/3): its RoPE settings are in no weight,
        args = getattr(model, "config", None)  # so without it two configs read alike (found in review)
    payload = {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "args": _jsonable(args) if args is not None else None,
        "dtype": _model_dtype(model),
        "kv_bits": kv_bits,
        "kv_group_size": kv_group_size if kv_bits else None,
        "weights": weights_fingerprint(model, weights=weights, adapter=adapter),
    }
    if max_kv_size is not None:
        payload["max_kv_size"] = max_kv_size
    if quantized_kv_start is not None and kv_bits:
        payload["quantized_kv_start"] = quantized_kv_start
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tokenizer_hash(tokenizer: Any) -> str:
    """xxh3-128 hex of the vocabulary (token -> id), sorted, plus the added tokens."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else dict(tok)
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def model_identity(
    model: Any,
    tokenizer: Any = None,
    *,
    model_id: str = "",
    namespace: str = "",
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    weights: str | os.PathLike[str] | None = None,
    adapter: str | os.PathLike[str] | None = None,
    max_kv_size: int | None = None,
    quantized_kv_start: int | None = None,
) -> Identity:
    """The identity of an mlx-lm model (and tokenizer, when given), weights and adapter included.

    ``weights`` (a model folder or a .safetensors file) fingerprints the weights from their files, once per
    file version; without it the parameters in memory are sampled. ``adapter`` (an adapter folder or file) is
    added to either. Pass the engine's cache settings as it makes its caches: ``max_kv_size`` (mlx-lm's
    ``make_prompt_cache(model, max_kv_size)``: a window) and ``quantized_kv_start`` (with ``kv_bits``), so that an
    engine set otherwise is never served these caches. Call it on the engine's thread: a lazily loaded model's
    parameters are evaluated here.
    """
    return Identity(
        model_id=model_id,
        config_fingerprint=config_fingerprint(
            model,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            weights=weights,
            adapter=adapter,
            max_kv_size=max_kv_size,
            quantized_kv_start=quantized_kv_start,
        ),
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else "",
        namespace=namespace,
    )
