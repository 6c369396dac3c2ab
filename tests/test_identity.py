"""Identity tells models apart by their weights: two fine-tunes of one base never restore each other's caches."""

from __future__ import annotations

import os
import shutil
import struct
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache

import spilld
from spilld import errors
from spilld import identity as ident_mod
from spilld.tinymodel import TinySpec, write_tiny_model


def _model(folder: str, seed: int) -> tuple[Any, Any]:
    write_tiny_model(folder, TinySpec(seed=seed))
    model, tokenizer = mlx_lm_load(folder)[:2]
    return model, tokenizer


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: Any) -> tuple[tuple[str, Any, Any], tuple[str, Any, Any]]:
    """One config and one tokenizer, other weights (a fine-tune of the same base)."""
    a, b = str(tmp_path_factory.mktemp("a")), str(tmp_path_factory.mktemp("b"))
    return (a, *_model(a, 1)), (b, *_model(b, 2))


def _prefill(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_same_config_and_tokenizer_other_weights_other_identity(two_models: Any) -> None:
    (pa, ma, ta), (pb, mb, tb) = two_models
    with open(os.path.join(pa, "config.json")) as fa, open(os.path.join(pb, "config.json")) as fb:
        assert fa.read() == fb.read()
    ia, ib = spilld.model_identity(ma, ta, model_id="m"), spilld.model_identity(mb, tb, model_id="m")
    assert ia.tokenizer_hash == ib.tokenizer_hash and ia.model_id == ib.model_id
    assert ia.config_fingerprint != ib.config_fingerprint
    # from the files: the same rule, and stable across loads of one folder
    fa_, fb_ = (spilld.model_identity(m, t, weights=p) for p, m, t in ((pa, ma, ta), (pb, mb, tb)))
    assert fa_.config_fingerprint != fb_.config_fingerprint
    assert spilld.model_identity(ma, ta, weights=pa) == fa_
    again, tok_again = mlx_lm_load(pa)[:2]
    assert spilld.model_identity(again, tok_again, model_id="m") == ia


@pytest.mark.asyncio
async def test_a_fine_tune_never_restores_another_ones_cache(two_models: Any, tmp_path: Any) -> None:
    (_, ma, ta), (_, mb, tb) = two_models
    tokens = list(range(1, 60))
    ia, ib = spilld.model_identity(ma, ta, model_id="base"), spilld.model_identity(mb, tb, model_id="base")
    a = await spilld.Spiller.open(tmp_path, identity=ia)
    assert (await a.spill(tokens, _prefill(ma, tokens))).stored
    await a.close()
    b = await spilld.Spiller.open(tmp_path, identity=ib)
    assert isinstance(await b.lookup([*tokens, 9]), spilld.Miss)
    assert await b.load([*tokens, 9]) is None
    await b.close()
    a2 = await spilld.Spiller.open(tmp_path, identity=ia)  # the negative control: its own model restores
    got = await a2.load([*tokens, 9])
    assert got is not None and got.tokens == tokens
    await a2.close()


def test_an_adapter_changes_the_identity(two_models: Any, tmp_path: Any) -> None:
    from mlx_lm.tuner.utils import linear_to_lora_layers

    (pa, ma, ta), _ = two_models
    base = spilld.model_identity(ma, ta)
    model, tok = mlx_lm_load(pa)[:2]
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 1.0, "dropout": 0.0})
    mx.eval(model.parameters())
    assert spilld.model_identity(model, tok).config_fingerprint != base.config_fingerprint
    # an adapter given as files: its bytes count
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"w": mx.ones((64, 4))})
    with_adapter = spilld.model_identity(ma, ta, adapter=adapter)
    assert with_adapter.config_fingerprint != base.config_fingerprint
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"w": mx.zeros((64, 4))})
    assert spilld.model_identity(ma, ta, adapter=adapter).config_fingerprint != with_adapter.config_fingerprint


def test_file_fingerprints_are_cached_by_path_size_and_mtime(two_models: Any, tmp_path: Any) -> None:
    (pa, _, _), _ = two_models
    folder = tmp_path / "m"
    shutil.copytree(pa, folder)
    weights = str(folder / "model.safetensors")
    first = ident_mod.files_fingerprint([folder])
    st = os.stat(weights)
    key = (os.path.realpath(weights), st.st_size, st.st_mtime_ns)
    assert key in ident_mod._file_digests
    ident_mod._file_digests[key] = "planted"  # a second call reads the cache, not the file
    assert ident_mod.files_fingerprint([folder]) != first
    # a model updated in place (same size, new bytes, new mtime) is read again
    with open(weights, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - 8)
        f.write(b"\x01" * 8)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    updated = ident_mod.files_fingerprint([folder])
    assert updated not in (first, "planted")


def test_a_safetensors_header_over_the_limit_is_refused(tmp_path: Any) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", ident_mod.MAX_SAFETENSORS_HEADER + 1) + b"{}" * 8)
    with pytest.raises(errors.FileFormatError, match="header length"):
        ident_mod.file_fingerprint(bad)
    small = tmp_path / "ok.safetensors"
    small.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert ident_mod.file_fingerprint(small)


def test_a_model_that_keeps_its_config_as_config_has_it_in_its_fingerprint() -> None:
    """Found in review: the fingerprint read ``model.args`` only; mlx-lm models that keep theirs as
    ``model.config`` (youtu_llm, plamo2, plamo3) had the same identity under another RoPE config, whose keys
    differ, and one's cache was served to the other."""
    import mlx.core as mx
    from mlx_lm.models import youtu_llm

    from spilld.identity import model_identity

    small = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
    )  # fmt: skip
    a = youtu_llm.Model(youtu_llm.ModelArgs(**small, rope_theta=10000.0))  # type: ignore[arg-type]
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    b = youtu_llm.Model(youtu_llm.ModelArgs(**small, rope_theta=1000000.0, rope_scaling=yarn))  # type: ignore[arg-type]
    b.update(a.parameters())  # the same weights, config.json edited
    mx.eval(a.parameters(), b.parameters())
    assert not hasattr(a, "args")
    assert model_identity(a, model_id="m").config_fingerprint != model_identity(b, model_id="m").config_fingerprint


def test_the_engines_cache_settings_are_in_the_identity(two_models: Any) -> None:
    """Found in review: an engine that makes its caches with a window (``max_kv_size``), or quantizes them from
    another token (``quantized_kv_start``, with ``kv_bits``), had the identity of one that does not: it was served
    a 64-token window for a 200-token prompt (next-step logits 1.75 off). Each setting is hashed when given; left
    out, the identity is the one made before it existed."""
    from types import SimpleNamespace

    from spilld.integrations.mlx_lm import ServerTiers

    (_, model, tok), _ = two_models
    fp = lambda **kw: spilld.model_identity(model, tok, model_id="m", **kw).config_fingerprint  # noqa: E731
    plain = fp()
    assert fp(max_kv_size=64) != plain and fp(max_kv_size=64) != fp(max_kv_size=128)
    assert fp(quantized_kv_start=0) == plain  # no KV quantization: where it would start is no difference
    assert fp(kv_bits=4, quantized_kv_start=0) != fp(kv_bits=4, quantized_kv_start=5000)
    assert fp(kv_bits=4) != plain
    unchanged = ident_mod.config_fingerprint(model)  # the payload as before: nothing new hashed when not given
    assert spilld.model_identity(model, tok, model_id="m").config_fingerprint == unchanged

    def server(start: int) -> Any:
        args = SimpleNamespace(kv_bits=4, kv_group_size=64, quantized_kv_start=start)
        return SimpleNamespace(model_key=("m",), model=model, tokenizer=tok, cli_args=args)

    ids = [ServerTiers(server(s), socket=None, folder=None).identity(("m",)) for s in (0, 5000)]
    assert ids[0].config_fingerprint != ids[1].config_fingerprint  # the server's own --quantized-kv-start
