"""Real tiny models: the reloaded cache gives exactly the live cache's next-step logits."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
import spilld.saver
from spilld import errors
from tests.models import MODELS, next_logits, prefill, random_tokens, tiny_llama


def _run(name: str, n_prompt: int = 40, n_decode: int = 12) -> tuple[Any, list[int], list[Any]]:
    model = MODELS[name]()
    tokens = random_tokens(n_prompt, seed=1)
    cache, logits = prefill(model, tokens)
    for _ in range(n_decode):  # decode past the rotating window and the chunk size
        tok = int(mx.argmax(logits).item())
        tokens.append(tok)
        logits = next_logits(model, cache, tok)
    return model, tokens, cache


@pytest.mark.parametrize("name", sorted(MODELS))
def test_reloaded_cache_gives_identical_next_logits(tmp_path: Any, name: str) -> None:
    model, tokens, cache = _run(name)
    kinds = {type(c).__name__ for c in cache}
    spilld.save(tmp_path / "f", tokens, cache)
    live = next_logits(model, cache, 7)
    got = spilld.load(tmp_path / "f")
    assert got.tokens == tokens and {type(c).__name__ for c in got.caches} == kinds
    assert mx.array_equal(next_logits(model, got.caches, 7), live).item()

    # negative controls: another prompt's cache, and one flipped value, change the logits
    other, _ = prefill(model, random_tokens(len(tokens), seed=2))
    assert mx.abs(next_logits(model, other, 7) - live).max().item() > 1e-3
    bad = spilld.load(tmp_path / "f").caches
    _perturb(bad[-1])
    assert not mx.array_equal(next_logits(model, bad, 7), live).item()


def _perturb(cache: Any) -> None:
    if isinstance(cache, C.CacheList):
        return _perturb(cache.caches[-1])
    if isinstance(cache, C.ArraysCache):
        cache.cache[-1] = cache.cache[-1] + 1.0
        return None
    n = min(cache.offset, cache.keys.shape[2])
    cache.values[..., n - 1, :] = cache.values[..., n - 1, :] + 1.0
    return None


def _differs(a: mx.array, b: mx.array) -> bool:
    return bool(mx.abs(a - b).max().item() > 1e-3)


def test_clone_then_save_async_matches_live(tmp_path: Any) -> None:
    import asyncio

    model, tokens, cache = _run("llama")
    clones = spilld.saver.clone_caches(cache)
    want = next_logits(model, cache, 3)  # what the cache gave at the clone
    # The engine goes on after handing off its clones: it drops its last 6 rows and decodes other tokens in their
    # place, rewriting rows the clones hold, in the same buffers.
    C.trim_prompt_cache(cache, 1 + 5)
    for t in (11, 12, 13, 14, 15):
        next_logits(model, cache, t)
    asyncio.run(spilld.saver.save_async(tmp_path / "f", tokens, clones))
    got = spilld.load(tmp_path / "f").caches
    assert mx.array_equal(next_logits(model, got, 3), want).item()
    # negative control: the rewritten rows change the logits, so a clone that shared them would have failed above
    assert _differs(next_logits(model, cache, 3), want)


def test_trimmed_load_matches_a_trimmed_live_cache(tmp_path: Any) -> None:
    model, tokens, cache = _run("llama")
    spilld.save(tmp_path / "f", tokens, cache)
    got = spilld.load(tmp_path / "f", upto=len(tokens) - 5)
    assert got.tokens == tokens[:-5]
    C.trim_prompt_cache(cache, 5)
    want = next_logits(model, cache, 9)
    assert mx.array_equal(next_logits(model, got.caches, 9), want).item()
    # negative control: the uncut entry answers otherwise, so a cut that did nothing would have failed above
    assert _differs(next_logits(model, spilld.load(tmp_path / "f").caches, 9), want)


def test_rotated_ring_cannot_be_cut(tmp_path: Any) -> None:
    _, tokens, cache = _run("gemma3")  # 52 tokens through a window of 8: the rings have wrapped
    spilld.save(tmp_path / "f", tokens, cache)
    assert spilld.loader.read_header(tmp_path / "f").trimmable is False
    with pytest.raises(errors.NotReusable):
        spilld.load(tmp_path / "f", upto=len(tokens) - 1)
    # negative control: rings that have not wrapped can be cut, and the cut entry answers like a cut live cache
    model, tokens, cache = _run("gemma3", n_prompt=6, n_decode=0)
    spilld.save(tmp_path / "g", tokens, cache)
    assert spilld.loader.read_header(tmp_path / "g").trimmable is True
    got = spilld.load(tmp_path / "g", upto=len(tokens) - 2)
    C.trim_prompt_cache(cache, 2)
    assert mx.array_equal(next_logits(model, got.caches, 9), next_logits(model, cache, 9)).item()


def test_a_chunked_cache_is_cut_only_at_or_past_the_chunk_boundary_after_its_start(tmp_path: Any) -> None:
    """Found in review: a Llama 4 chunked cache whose front was trimmed (``start_position`` > 0) could be cut to any
    length from ``start_position`` on, but a token attends from the start of its chunk: a cut short of the next
    chunk boundary lacked rows, and was served with wrong logits. Every cut allowed now answers as a fresh
    prefill does; the ones short of the boundary are refused."""
    model = MODELS["llama4"]()  # chunks of 16
    tokens = random_tokens(41, seed=3)
    cache, _ = prefill(model, tokens[:4])
    for t in tokens[4:40]:
        next_logits(model, cache, t)  # decoding trims the chunked layers' front
    start, chunk = cache[0].start_position, cache[0].chunk_size
    assert start % chunk, "the test needs a start inside a chunk"
    spilld.save(tmp_path / "f", tokens[:40], cache)
    boundary = -(-start // chunk) * chunk
    for upto in range(start, 40):
        if upto < boundary:
            with pytest.raises(errors.NotReusable):
                spilld.load(tmp_path / "f", upto=upto)
            continue
        got = spilld.load(tmp_path / "f", upto=upto)
        fresh, _ = prefill(model, tokens[:upto])
        diff = mx.abs(next_logits(model, got.caches, tokens[upto]) - next_logits(model, fresh, tokens[upto]))
        assert float(diff.max()) < 1e-4, upto


@pytest.mark.asyncio
async def test_a_lookup_never_prefers_a_chunked_entry_it_cannot_cut_to(tmp_path: Any) -> None:
    """Found in review: a later turn's chunked entry, usable for as many tokens as the turn before it by
    ``min_reusable`` alone, was chosen over that correct entry (newer), and served wrong logits."""
    model = MODELS["llama4"]()
    tokens = random_tokens(30, seed=1)
    turn1, _ = prefill(model, tokens[:15])
    turn2, _ = prefill(model, tokens[:10])
    for t in tokens[10:]:
        next_logits(model, turn2, t)  # on to 30: its front trimmed past 15's chunk start
    assert 0 < turn2[0].start_position < 16
    prompt = [*tokens[:15], 7, 8, 9]
    async with spilld.Spiller(str(tmp_path), identity=spilld.Identity("llama4")) as sp:
        assert (await sp.spill(tokens[:15], turn1, droppable=False)).stored
        assert (await sp.spill(tokens, turn2, droppable=False)).stored
        got = await sp.load(prompt)
    assert got is not None and len(got.tokens) == 15
    fresh, _ = prefill(model, prompt[:15])
    assert mx.array_equal(next_logits(model, got.caches, prompt[15]), next_logits(model, fresh, prompt[15])).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_cache_from_a_real_model(tmp_path: Any, bits: int) -> None:
    model = tiny_llama(hidden=128)  # head_dim 32: the smallest quantization group
    tokens = random_tokens(40)
    cache, _ = prefill(model, tokens)
    qcache = [c.to_quantized(group_size=32, bits=bits) for c in cache]
    spilld.save(tmp_path / "f", tokens, qcache)
    live = next_logits(model, qcache, 5)
    got = spilld.load(tmp_path / "f").caches
    assert isinstance(got[0], C.QuantizedKVCache) and got[0].bits == bits
    assert mx.array_equal(next_logits(model, got, 5), live).item()
    # negative control: another prompt's quantized cache answers otherwise
    other, _ = prefill(model, random_tokens(40, seed=2))
    assert _differs(next_logits(model, [c.to_quantized(group_size=32, bits=bits) for c in other], 5), live)


def test_identity_fields_follow_the_model() -> None:
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    ia, ib = spilld.model_identity(a), spilld.model_identity(b)
    assert ia.config_fingerprint != ib.config_fingerprint  # same shape of KV, other weights: other caches
    assert spilld.model_identity(tiny_llama(seed=0)) == ia  # the same weights again: the same identity
    assert spilld.model_identity(a, kv_bits=4, kv_group_size=64).config_fingerprint != ia.config_fingerprint
    other = MODELS["gemma3"]()
    assert spilld.model_identity(other).config_fingerprint != ia.config_fingerprint
    a.set_dtype(mx.float16)
    assert spilld.model_identity(a).config_fingerprint != ia.config_fingerprint
    assert spilld.model_identity(b, model_id="m", namespace="ns").model_id == "m"


def test_tokenizer_hash_follows_the_vocabulary() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def tok(vocab: dict[str, int]) -> Any:
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))

    v = {"<unk>": 0, "hello": 1, "world": 2}
    h1 = spilld.model_identity(tiny_llama(), tok(v)).tokenizer_hash
    assert h1 == spilld.model_identity(tiny_llama(), tok(dict(v))).tokenizer_hash
    assert h1 != spilld.model_identity(tiny_llama(), tok({**v, "world": 3, "x": 2})).tokenizer_hash
    assert len(h1) == 32
