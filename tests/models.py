"""Tiny random-weight mlx-lm models for tests (a small "model zoo").

Every builder seeds mlx's global RNG, constructs the model, casts it to
float32 and evaluates its parameters, so two calls with the same seed give
bit-identical weights.  No weights are downloaded; everything is built in code.

Cache layouts produced by ``mlx_lm.models.cache.make_prompt_cache``:

- ``tiny_llama``      -> [KVCache] * 2
- ``tiny_llama4``     -> [ChunkedKVCache, ChunkedKVCache, ChunkedKVCache, KVCache]
- ``tiny_gemma3``     -> [RotatingKVCache, RotatingKVCache, KVCache]
- ``tiny_mamba2``     -> [ArraysCache] * 2
- ``tiny_falcon_h1``  -> [CacheList(ArraysCache, KVCache)] * 2

Run ``python tests/models.py`` for a self-check.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import falcon_h1, gemma3_text, llama, llama4, mamba2
from mlx_lm.models.cache import make_prompt_cache

VOCAB = 256


def _finish(model: nn.Module) -> nn.Module:
    """Cast a freshly built model to float32, evaluate its weights and return it."""
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def tiny_llama(seed: int = 0, hidden: int = 64) -> nn.Module:
    """Build a 2-layer Llama (GQA 4q/2kv heads) whose cache is [KVCache] * 2."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    return _finish(llama.Model(args))


def tiny_llama4(seed: int = 0, moe: bool = False) -> nn.Module:
    """Build a 4-layer Llama4 text model: 3 ChunkedKVCache layers (chunk 16) + 1 global KVCache."""
    mx.random.seed(seed)
    text_config = dict(
        model_type="llama4_text",
        attention_bias=False,
        attention_chunk_size=16,
        head_dim=16,
        hidden_size=64,
        # layer i is MoE iff i % step == step - 1; a huge step disables MoE.
        interleave_moe_layer_step=4 if moe else 10_000,
        intermediate_size=128,  # expert / shared-expert width (MoE layers only)
        intermediate_size_mlp=128,  # dense MLP width
        max_position_embeddings=4096,
        num_attention_heads=4,
        num_experts_per_tok=1,  # MoE asserts top_k == 1
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_local_experts=2,
        rms_norm_eps=1e-5,
        rope_scaling=None,
        rope_theta=500000.0,
        use_qk_norm=True,
        vocab_size=VOCAB,
    )
    args = llama4.ModelArgs(text_config=text_config, model_type="llama4")
    return _finish(llama4.Model(args))


def tiny_gemma3(seed: int = 0) -> nn.Module:
    """Build a 3-layer Gemma3 text model: 2 RotatingKVCache (window 8) layers + 1 global KVCache."""
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        query_pre_attn_scalar=16,
        sliding_window=8,
        sliding_window_pattern=3,  # layers 0,1 sliding; layer 2 global
        max_position_embeddings=4096,
    )
    return _finish(gemma3_text.Model(args))


def tiny_mamba2(seed: int = 0) -> nn.Module:
    """Build a 2-layer Mamba2 SSM whose cache is [ArraysCache(size=2)] * 2 (conv state, ssm state)."""
    mx.random.seed(seed)
    args = mamba2.ModelArgs(
        model_type="mamba2",
        num_heads=4,
        head_dim=16,  # inner width = num_heads * head_dim = 64
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,  # unused by the block; required field
        state_size=16,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank="auto",
    )
    return _finish(mamba2.Model(args))


def tiny_falcon_h1(seed: int = 0) -> nn.Module:
    """Build a 2-layer hybrid Falcon-H1 whose cache is [CacheList(ArraysCache, KVCache)] * 2."""
    mx.random.seed(seed)
    args = falcon_h1.ModelArgs(
        model_type="falcon_h1",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_ssm=64,  # must equal mamba_n_heads * mamba_d_head
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        # The tied head scales logits by lm_head_multiplier / embedding_multiplier
        # (defaults: ~0.0069), which squashes random-weight logits to near-uniform.
        # All other mu-P multipliers are only folded in by sanitize(), so with
        # both at 1.0 the forward pass is unscaled.
        lm_head_multiplier=1.0,
        embedding_multiplier=1.0,
    )
    return _finish(falcon_h1.Model(args))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "llama": tiny_llama,
    "llama4": tiny_llama4,
    "gemma3": tiny_gemma3,
    "mamba2": tiny_mamba2,
    "falcon_h1": tiny_falcon_h1,
}


def num_params(model: nn.Module) -> int:
    """Return the total number of scalar parameters in ``model``."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def cache_arrays(cache: Any) -> list[mx.array]:
    """Return every mx.array reachable from a cache object, a cache list, or its ``state``."""
    out: list[mx.array] = []

    def walk(x: Any) -> None:
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "state"):
            walk(x.state)

    walk(cache)
    return out


def _last_logits(out: mx.array) -> mx.array:
    """Return the last-position logits of a (1, L, V) output as a 1-D float32 array."""
    return out[0, -1].astype(mx.float32)


def prefill(model: nn.Module, tokens: list[int], cache: list | None = None) -> tuple[list, mx.array]:
    """Run ``tokens`` through ``model`` (making a prompt cache if needed); return (cache, last logits)."""
    if cache is None:
        cache = make_prompt_cache(model)
    out = model(mx.array(tokens)[None], cache=cache)
    logits = _last_logits(out)
    mx.eval(logits, cache_arrays(cache))
    return cache, logits


def next_logits(model: nn.Module, cache: list, token: int) -> mx.array:
    """Run one single-token decode step with ``cache`` and return the evaluated 1-D logits."""
    out = model(mx.array([[token]]), cache=cache)
    logits = _last_logits(out)
    mx.eval(logits, cache_arrays(cache))
    return logits


def random_tokens(n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    """Return ``n`` deterministic pseudo-random token ids in [0, vocab) (does not touch mx's RNG)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _describe(c: Any) -> str:
    """Return a short class-name description of one layer cache (expanding CacheList)."""
    if hasattr(c, "caches"):
        return f"{type(c).__name__}({', '.join(_describe(s) for s in c.caches)})"
    return type(c).__name__


if __name__ == "__main__":
    import math
    import time

    prompt = random_tokens(40, seed=1)
    other = random_tokens(40, seed=2)
    ok = True
    for name, build in MODELS.items():
        t0 = time.perf_counter()
        model = build(seed=0)
        t_build = time.perf_counter() - t0
        print(f"== {name}: {num_params(model):,} params (built in {t_build * 1e3:.0f} ms)")

        # warm-up (first call compiles / allocates), then time a fresh 40-token prefill
        prefill(model, prompt)
        t0 = time.perf_counter()
        cache, logits = prefill(model, prompt)
        t_prefill = time.perf_counter() - t0
        print(f"   prefill 40 tok: {t_prefill * 1e3:.1f} ms, logits {logits.shape} {logits.dtype}")
        print(f"   caches: [{', '.join(_describe(c) for c in cache)}]")
        shapes = [(tuple(a.shape), str(a.dtype)) for a in cache_arrays(cache[0])]
        print(f"   cache[0] arrays: {shapes}")
        dtypes = {str(a.dtype) for c in cache for a in cache_arrays(c)}
        print(f"   all cache dtypes: {sorted(dtypes)}")

        t0 = time.perf_counter()
        nxt = next_logits(model, cache, 7)
        t_step = time.perf_counter() - t0
        finite = bool(mx.all(mx.isfinite(nxt)).item())
        print(f"   next_logits: shape {nxt.shape}, finite={finite}, {t_step * 1e3:.1f} ms")
        after = [(tuple(a.shape)) for a in cache_arrays(cache[0])]
        print(f"   cache[0] arrays after 1 decode step: {after}")
        ok &= finite and nxt.shape == (VOCAB,) and logits.dtype == mx.float32

        # determinism: same seed + same prompt -> identical logits
        m2 = build(seed=0)
        c2, _ = prefill(m2, prompt)
        same = bool(mx.array_equal(next_logits(m2, c2, 7), nxt).item())
        # negative control: a different prompt must give different next logits
        c3, _ = prefill(model, other)
        diff = float(mx.abs(next_logits(model, c3, 7) - nxt).max().item())
        print(f"   same-seed rebuild identical={same}; other-prompt max|dlogit|={diff:.4g}")
        ok &= same and diff > 0 and not math.isnan(diff)

    print("ALL OK" if ok else "FAILURES")
    raise SystemExit(0 if ok else 1)
