"""Round trips of every mlx-lm 0.32 cache class through the file format."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
import spilld.saver
from spilld import errors
from spilld.codecs import Codec, CodecProvider, default_provider
from tests.caches import chunked, fill, kv, live, same


def roundtrip(tmp_path: Any, caches: list[Any], tokens: list[int] | None = None) -> spilld.Loaded:
    path = os.path.join(tmp_path, "c.spilld")
    spilld.save(path, tokens or [], caches)
    return spilld.load(path)


def _quantized(n: int, bits: int) -> Any:
    c = C.QuantizedKVCache(group_size=32, bits=bits)
    return fill(c, n, chunk=3, dim=64)


def _batch_kv() -> Any:
    a, b = fill(C.KVCache(), 7), fill(C.KVCache(), 12, seed=3)
    c = C.BatchKVCache.merge([a, b])
    c.update_and_fetch(*kv(1, batch=2, seed=9))
    return c


def _batch_rot(steps: int) -> Any:
    c = C.BatchRotatingKVCache(max_size=8, left_padding=[2, 0])
    c.update_and_fetch(*kv(6, batch=2))
    for i in range(steps):
        c.update_and_fetch(*kv(1, batch=2, seed=10 + i))
    return c


def _arrays(with_none: bool) -> Any:
    c = C.ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 16))
    if not with_none:
        c[1] = mx.random.normal((1, 4, 8, 8)).astype(mx.bfloat16)
    c[2] = mx.arange(5, dtype=mx.int32)[None]
    return c


CASES: dict[str, Callable[[], Any]] = {
    "kv": lambda: fill(C.KVCache(), 300, chunk=3),
    "kv_bf16": lambda: fill(C.KVCache(), 20, dtype=mx.bfloat16),
    "kv_f16_heads8": lambda: fill(C.KVCache(), 33, heads=8, dtype=mx.float16),
    "kv_exact_step": lambda: fill(C.KVCache(), 256),
    "concat": lambda: fill(C.ConcatenateKVCache(), 10, chunk=2),
    "rotating_prewrap": lambda: fill(C.RotatingKVCache(max_size=32, keep=4), 20, chunk=5),
    "rotating_wrapped": lambda: fill(C.RotatingKVCache(max_size=16, keep=4), 40, chunk=9),
    "rotating_concat_wrapped": lambda: fill(C.RotatingKVCache(max_size=16, keep=2), 40),
    "quantized4": lambda: _quantized(21, 4),
    "quantized8": lambda: _quantized(21, 8),
    "chunked": lambda: chunked(14),
    "arrays": lambda: _arrays(False),
    "arrays_none": lambda: _arrays(True),
    "cachelist": lambda: C.CacheList(_arrays(True), fill(C.KVCache(), 9)),
    "cachelist_nested": lambda: C.CacheList(C.CacheList(fill(C.KVCache(), 5)), fill(C.RotatingKVCache(8), 5)),
    "batch_kv": _batch_kv,
    "batch_rotating": lambda: _batch_rot(1),
    "batch_rotating_rotated": lambda: _batch_rot(6),
    "empty_kv": C.KVCache,
    "empty_rotating": lambda: C.RotatingKVCache(max_size=16, keep=4),
    "empty_quantized": lambda: C.QuantizedKVCache(bits=4),
    "empty_chunked": lambda: C.ChunkedKVCache(8),
    "empty_concat": C.ConcatenateKVCache,
    "empty_arrays": lambda: C.ArraysCache(2),
    "empty_batch_kv": lambda: C.BatchKVCache([1, 0]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_roundtrip_exact(tmp_path: Any, name: str) -> None:
    cache = CASES[name]()
    mx.eval(live(cache))
    got = roundtrip(tmp_path, [cache]).caches[0]
    assert type(got) is type(cache)
    assert same(live(got), live(cache))


@pytest.mark.parametrize("name", sorted(CASES))
def test_resave_gives_identical_hashes(tmp_path: Any, name: str) -> None:
    cache = CASES[name]()
    a = spilld.save(tmp_path / "a", [], [cache]).header
    again = spilld.load(tmp_path / "a").caches
    b = spilld.save(tmp_path / "b", [], again).header
    assert [s.hash for s in a.slots()] == [s.hash for s in b.slots()]
    assert [s.shape for s in a.slots()] == [s.shape for s in b.slots()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_clone_matches_and_is_detached(tmp_path: Any, name: str) -> None:
    cache = CASES[name]()
    clone = spilld.saver.clone_caches([cache])[0]
    assert type(clone) is type(cache)
    before = frozen(live(cache))
    assert frozen(live(clone)) == before
    # The engine goes on: it writes over every array the cache held at the clone (in place: mlx rebinds the same
    # Python object), then runs its own steps, which rewrite the clone's rows (trim and refill, a ring that wraps,
    # a slot replaced). The clone must keep the old data through both.
    scribble(cache)
    engine_steps(cache)
    assert frozen(live(cache)) != before  # the mutations reached the original (or this test checks nothing)
    assert frozen(live(clone)) == before


def frozen(x: Any) -> Any:
    """A deep copy of nested arrays and scalars, as numpy (bfloat16 widened exactly), for later comparison."""
    import numpy as np

    if isinstance(x, mx.array):
        a = np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, copy=True)
        return ("array", str(x.dtype), a.shape, a.tobytes())
    if isinstance(x, (list, tuple)):
        return [frozen(v) for v in x]
    if isinstance(x, dict):
        return {k: frozen(v) for k, v in x.items()}
    return x


def scribble(cache: Any) -> None:
    from tests.caches import _arrays

    for a in _arrays(cache):
        a[...] = mx.array(7).astype(a.dtype)
    mx.eval(_arrays(cache))


def engine_steps(cache: Any) -> None:
    """Decode steps that rewrite every row a clone holds (or fill an empty cache)."""
    if isinstance(cache, C.CacheList):
        for c in cache.caches:
            engine_steps(c)
        return
    if isinstance(cache, C.ArraysCache):
        for i in range(len(cache.cache)):
            cache[i] = mx.full((1, 2, 3), 5.0)  # a recurrent state is replaced each step
        return
    shape = like(cache)
    if isinstance(cache, (C.RotatingKVCache, C.BatchRotatingKVCache)):
        for i in range(cache.max_size + 1):  # the ring wraps: every slot is written again
            cache.update_and_fetch(*kv(1, seed=50 + i, **shape))
        return
    n = max(1, cache.trim(cache._idx if isinstance(cache, C.BatchKVCache) else cache.offset))
    cache.update_and_fetch(*kv(n, seed=99, **shape))  # trimmed to nothing, then refilled with other rows


def like(cache: Any) -> dict[str, Any]:
    """The shape of the rows an engine would append to ``cache``."""
    batch = cache.left_padding.shape[0] if isinstance(cache, (C.BatchKVCache, C.BatchRotatingKVCache)) else 1
    k = getattr(cache, "keys", None)
    if k is None:
        return {"batch": batch, "dim": getattr(cache, "group_size", 8)}  # quantized rows: one group at least
    if isinstance(cache, C.QuantizedKVCache):  # packed: 32 / bits values per uint32, scales in the keys' dtype
        return {"batch": batch, "heads": k[0].shape[1], "dim": k[0].shape[-1] * 32 // cache.bits, "dtype": k[1].dtype}
    return {"batch": batch, "heads": k.shape[1], "dim": k.shape[-1], "dtype": k.dtype}


def test_empty_clone_is_empty() -> None:
    for make in (C.KVCache, C.ConcatenateKVCache, lambda: C.RotatingKVCache(8)):
        c = spilld.saver.clone_caches([make()])[0]
        assert c.empty()


def test_kv_saves_live_rows_only_and_loads_with_step_capacity(tmp_path: Any) -> None:
    cache = fill(C.KVCache(), 10)
    assert cache.keys.shape[2] == 256  # mlx-lm's step padding
    h = spilld.save(tmp_path / "f", [], [cache]).header
    assert h.caches[0].tensors[0].shape == (1, 2, 10, 8)
    got = spilld.load(tmp_path / "f").caches[0]
    assert got.keys.shape[2] == 256 and got.offset == 10
    # the next decode step appends in place: no reallocation
    got.update_and_fetch(*kv(1, seed=5))
    assert got.keys.shape[2] == 256 and got.offset == 11


def test_trimmed_concatenate_stays_trimmed(tmp_path: Any) -> None:
    cache = fill(C.ConcatenateKVCache(), 12)
    cache.trim(5)
    got = roundtrip(tmp_path, [cache]).caches[0]
    assert got.offset == 7 and got.keys.shape[2] == 7
    # mlx-lm's own format brings it back untrimmed (the bug we must not inherit)
    C.save_prompt_cache(str(tmp_path / "m.safetensors"), [cache])
    assert C.load_prompt_cache(str(tmp_path / "m.safetensors"))[0].offset == 12


def test_batch_rotating_false_stays_false(tmp_path: Any) -> None:
    cache = _batch_rot(1)
    assert cache.rotated is False
    assert roundtrip(tmp_path, [cache]).caches[0].rotated is False


@pytest.mark.parametrize(
    ("name", "trimmable"),
    [
        ("kv", True),
        ("rotating_prewrap", True),
        ("rotating_wrapped", False),
        ("arrays", False),
        ("cachelist", False),
        ("chunked", True),
        ("batch_rotating_rotated", False),
    ],
)
def test_trimmability_from_header_alone(tmp_path: Any, name: str, trimmable: bool) -> None:
    spilld.save(tmp_path / "f", [], [CASES[name]()])
    assert spilld.loader.read_header(tmp_path / "f").trimmable is trimmable


def test_chunked_min_reusable_is_start_position_and_a_cut_ends_past_a_chunk_boundary(tmp_path: Any) -> None:
    """The stored ``min_reusable`` is ``start_position``; a cut may end no earlier than the chunk boundary at or
    after it (tests/test_models.py checks the logits of every cut of a real model's chunked cache)."""
    cache = chunked(14)
    start, size = cache.start_position, cache.chunk_size
    assert start % size
    h = spilld.save(tmp_path / "f", list(range(14)), [cache]).header
    assert h.min_reusable_offset == start
    boundary = -(-start // size) * size
    for upto in range(start - 1, boundary):
        with pytest.raises(errors.NotReusable):
            spilld.load(tmp_path / "f", upto=upto)
    got = spilld.load(tmp_path / "f", upto=boundary)
    assert got.caches[0].offset == boundary and got.caches[0].start_position == start


def test_unknown_class_is_refused(tmp_path: Any) -> None:
    class Mine(C.KVCache):
        pass

    with pytest.raises(errors.UnsupportedCache):
        spilld.save(tmp_path / "f", [], [Mine()])
    assert os.listdir(tmp_path) == []


class _DoublingCache:
    """An engine's own cache class, to show the registry is open."""

    def __init__(self, data: mx.array | None = None) -> None:
        self.data = data


class _DoublingCodec(Codec):
    kind = "doubling"

    def cache_type(self) -> type:
        return _DoublingCache

    def encode(self, cache: Any, ctx: Any) -> Any:
        return self.entry(offset=None, trimmable=False, arrays=[cache.data])

    def decode(self, entry: Any, ctx: Any) -> Any:
        return _DoublingCache(ctx.read(entry.tensors[0]))

    def clone(self, cache: Any, ctx: Any) -> Any:
        return _DoublingCache(cache.data)


def test_engine_registers_its_own_codec(tmp_path: Any) -> None:
    mine = default_provider().extended("engine-doubling/1", [_DoublingCodec()])
    data = mx.arange(10, dtype=mx.float32)
    spilld.save(tmp_path / "f", [], [_DoublingCache(data), fill(C.KVCache(), 3)], provider=mine)
    got = spilld.load(tmp_path / "f", provider=mine)
    assert same(got.caches[0].data, data)
    with pytest.raises(errors.CodecProviderMismatch):
        spilld.load(tmp_path / "f")


def test_an_extended_providers_built_in_kinds_keep_their_rules(tmp_path: Any) -> None:
    """Found in review: a file of an extended provider skipped every rule of §5.1 (its id had no rule table), yet
    the built-in codecs decoded it: a quantized cache of 1 bit in groups of 7 reached the engine, which failed."""
    from spilld import format as fmt
    from spilld.codecs.rules import rules_for
    from tests.hostile import join, split

    mine = default_provider().extended("engine-y/1", [_DoublingCodec()])
    assert rules_for("engine-y/1") is not None
    spilld.save(
        tmp_path / "good", [], [_DoublingCache(mx.arange(4, dtype=mx.float32)), fill(C.KVCache(), 3)], provider=mine
    )
    assert spilld.load(tmp_path / "good", provider=mine).caches[1].offset == 3  # its own kind, unruled, still loads
    q = C.QuantizedKVCache(group_size=32, bits=4)
    q.update_and_fetch(*kv(5, dim=32))
    spilld.save(tmp_path / "q", [], [q], provider=mine)
    with open(tmp_path / "q", "rb") as f:
        wire, body = split(f.read())
    wire["caches"][0]["fields"] = {"group_size": 7, "bits": 1}  # what mlx-lm never writes (rule 6)
    with open(tmp_path / "bad", "wb") as f:
        f.write(join(wire, body, version=fmt.FORMAT_VERSION))
    with pytest.raises(errors.QuantizationInvalid):
        spilld.load(tmp_path / "bad", provider=mine)


def test_a_provider_built_from_the_built_in_codecs_keeps_their_rules(tmp_path: Any) -> None:
    """Found in review: a provider made with ``CodecProvider(id, codecs)`` from the built-in codecs, not through
    ``extended``, registered no rules for its id. Its files skipped every rule of §5.1 (a quantized cache of 1 bit
    in groups of 7 was loaded), and ``cut_floor`` knew no chunk size, so a chunked cache was cut short of the chunk
    boundary after its ``start_position`` (on Llama 4, next-step logits off by ~1 from a fresh prefill's)."""
    from spilld import format as fmt
    from tests.hostile import join, split

    base = default_provider()
    mine = CodecProvider("engine-direct/1", [base.for_cache(C.ChunkedKVCache(8)), base.for_cache(C.QuantizedKVCache())])
    cache = chunked(14)
    start, size = cache.start_position, cache.chunk_size
    assert start % size
    spilld.save(tmp_path / "c", list(range(14)), [cache], provider=mine)
    with pytest.raises(errors.NotReusable):
        spilld.load(tmp_path / "c", upto=start + 1, provider=mine)
    boundary = -(-start // size) * size
    assert spilld.load(tmp_path / "c", upto=boundary, provider=mine).caches[0].offset == boundary
    q = C.QuantizedKVCache(group_size=32, bits=4)
    q.update_and_fetch(*kv(5, dim=32))
    spilld.save(tmp_path / "q", [], [q], provider=mine)
    with open(tmp_path / "q", "rb") as f:
        wire, body = split(f.read())
    wire["caches"][0]["fields"] = {"group_size": 7, "bits": 1}
    with open(tmp_path / "bad", "wb") as f:
        f.write(join(wire, body, version=fmt.FORMAT_VERSION))
    with pytest.raises(errors.QuantizationInvalid):
        spilld.load(tmp_path / "bad", provider=mine)


def test_provider_rejects_duplicate_kinds() -> None:
    with pytest.raises(ValueError):
        CodecProvider("x", [_DoublingCodec(), _DoublingCodec()])
    with pytest.raises(ValueError):
        CodecProvider("", [])


def test_zero_row_caches_roundtrip(tmp_path: Any) -> None:
    kvc = fill(C.KVCache(), 5)
    kvc.trim(5)
    cat = fill(C.ConcatenateKVCache(), 4)
    cat.trim(4)
    att = spilld.Attachment("empty/1", {}, [mx.zeros((0, 3)), mx.arange(3)])
    spilld.save(tmp_path / "f", [], [kvc, cat], attachments=[att])
    got = spilld.load(tmp_path / "f")
    assert got.caches[0].offset == 0 and got.caches[1].offset == 0
    assert got.attachments[0].tensors[0].shape == (0, 3)
    assert same(got.attachments[0].tensors[1], mx.arange(3))


def test_writer_refuses_what_the_reader_would(tmp_path: Any) -> None:
    from spilld import format as fmt

    deep: Any = fill(C.KVCache(), 2)
    for _ in range(fmt.MAX_NESTING + 1):
        deep = C.CacheList(deep)
    with pytest.raises(errors.NestingTooDeep):
        spilld.save(tmp_path / "f", [], [deep])
    ok: Any = fill(C.KVCache(), 2)
    for _ in range(fmt.MAX_NESTING):
        ok = C.CacheList(ok)
    spilld.save(tmp_path / "g", [], [ok])
    assert same(live(spilld.load(tmp_path / "g").caches[0]), live(ok))
    with pytest.raises(errors.RankTooLarge):
        spilld.save(
            tmp_path / "f", [], [], attachments=[spilld.Attachment("r", {}, [mx.zeros((1,) * (fmt.MAX_RANK + 1))])]
        )
    assert sorted(os.listdir(tmp_path)) == ["g"]


def test_a_trailing_empty_tensor_does_not_extend_the_file(tmp_path: Any) -> None:
    att = spilld.Attachment("x", {}, [mx.ones((10,)), mx.zeros((0,))])
    res = spilld.save(tmp_path / "f", [], [fill(C.KVCache(), 3)], attachments=[att])
    assert os.path.getsize(tmp_path / "f") == res.file_bytes
    got = spilld.load(tmp_path / "f")  # the writer never publishes what its reader refuses
    assert got.attachments[0].tensors[1].shape == (0,)
    big = [fill(C.KVCache(), 4096, heads=8, dim=128)]  # the O_DIRECT path too
    res = spilld.save(tmp_path / "g", [], big, attachments=[att], direct=True)
    assert os.path.getsize(tmp_path / "g") == res.file_bytes and spilld.load(tmp_path / "g").caches


def test_a_concatenate_cache_loaded_as_a_shorter_prefix_continues_like_a_fresh_prefill(tmp_path: Any) -> None:
    """Found in review: a restore cut back to a shorter prefix trimmed a ``ConcatenateKVCache`` by its offset only,
    and its next update concatenated onto every stored row: the model attended to tokens not in the prompt."""
    from tests.models import tiny_llama

    model = tiny_llama()
    base = [(7 * i) % 250 for i in range(40)]
    spilled = [C.ConcatenateKVCache() for _ in model.layers]
    mx.eval(model(mx.array([base]), cache=spilled))
    spilld.save(tmp_path / "f", base, spilled)
    prompt = [*base[:30], 201, 202, 203]
    got = spilld.load(tmp_path / "f", upto=30).caches
    assert got[0].offset == 30 and got[0].keys.shape[2] == 30
    restored = model(mx.array([prompt[30:]]), cache=got)[0, -1]
    fresh = model(mx.array([prompt]), cache=[C.ConcatenateKVCache() for _ in model.layers])[0, -1]
    assert mx.allclose(restored, fresh, atol=1e-4).item()
    whole = spilld.load(tmp_path / "f").caches  # negative control: the 40 tokens kept, the answer differs
    assert not mx.allclose(model(mx.array([prompt[30:]]), cache=whole)[0, -1], fresh, atol=1e-4).item()


def test_a_concatenate_cache_inside_a_cache_list_is_cut_to_the_rows_it_serves(tmp_path: Any) -> None:
    """Found in review: the cut of a ``CacheList`` went through its trim, which calls its children's own: a
    ``ConcatenateKVCache`` inside one kept the rows of the tokens cut off."""
    spilld.save(tmp_path / "f", list(range(40)), [C.CacheList(fill(C.ConcatenateKVCache(), 40), fill(C.KVCache(), 40))])
    got = spilld.load(tmp_path / "f", upto=30).caches[0]
    concat, plain = got.caches
    assert (concat.offset, concat.keys.shape[2]) == (30, 30) and plain.offset == 30
    want = fill(C.ConcatenateKVCache(), 40)
    assert same(concat.keys, want.keys[..., :30, :]) and same(concat.values, want.values[..., :30, :])


def test_one_provider_id_names_one_table() -> None:
    """Found in review: a second ``extended`` under an id already in use, with other codecs, replaced the first
    table, and the first provider's own files were then refused (and quarantined by a store)."""
    default_provider().extended("engine-once/1", [_DoublingCodec()])
    default_provider().extended("engine-once/1", [_DoublingCodec()])  # the same table again: fine
    with pytest.raises(ValueError):
        default_provider().extended("engine-once/1", [])


def test_a_load_cuts_no_further_than_the_tokens_its_caches_hold(tmp_path: Any) -> None:
    """Found in review: a file of 10 tokens whose cache holds 5 loaded with ``upto=8`` gave 8 tokens beside 5 rows:
    a caller would skip the prefill of 3 tokens the cache never saw. A cut past the tokens the caches hold is
    ``NotReusable``; a load without ``upto`` gives the file as saved (a draft model's caches hold a row fewer)."""
    path = tmp_path / "short.spilld"
    spilld.save(path, list(range(10)), [fill(C.KVCache(), 5)], durability="none")
    got = spilld.load(path)
    assert got.tokens == list(range(10)) and got.caches[0].offset == 5
    assert spilld.load(path, upto=5).tokens == list(range(5))
    cut = spilld.load(path, upto=3)
    assert cut.tokens == list(range(3)) and cut.caches[0].offset == 3
    for upto in (6, 8, 10):
        with pytest.raises(errors.NotReusable):
            spilld.load(path, upto=upto)


def test_a_file_saved_without_tokens_is_cut_to_none_only_when_its_caches_can_be(tmp_path: Any) -> None:
    """Found in review: ``upto=0`` of a file saved without tokens (the ``save_prompt_cache`` drop-in) took the
    no-cut path for ``upto`` equal to the tokens recorded, and gave back every cache as saved: 10 rows beside 0
    tokens, a wrapped ring included (which cannot be cut at all)."""
    path = tmp_path / "tokenless.spilld"
    spilld.save(path, [], [fill(C.KVCache(), 10)], durability="none")
    got = spilld.load(path, upto=0)
    assert got.tokens == [] and got.caches[0].offset == 0
    spilld.save(path, [], [fill(C.KVCache(), 10), fill(C.RotatingKVCache(4), 10)], durability="none")
    with pytest.raises(errors.NotReusable):
        spilld.load(path, upto=0)
    assert [c.offset for c in spilld.load(path).caches] == [10, 10]  # without ``upto``: the file as saved
