"""A tiny random-weight llama and a byte-level tokenizer, written to a local folder.

``mlx_lm.load`` (and so ``mlx_lm.server``) reads the folder like any model from the
hub, but nothing is downloaded: the weights are random (seeded) and the tokenizer
maps each byte to one token. The demo and the server tests run on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SPECIAL_TOKENS = ("<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """The model's shape; the defaults prefill a few thousand tokens in about a second on 2 CPU cores."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    seed: int = 0


def byte_alphabet() -> list[str]:
    """One printable character per byte value (the GPT-2 byte-level convention), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer without merges: 256 byte tokens, then <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def model_config(spec: TinySpec) -> dict[str, object]:
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "tie_word_embeddings": True,
        "max_position_embeddings": 1 << 16,
        "bos_token_id": 256,
        "eos_token_id": 257,
    }


def write_tiny_model(folder: str, spec: TinySpec = TinySpec()) -> str:
    """Write config, float32 weights and tokenizer to ``folder``; returns the folder. Same spec, same bytes.

    Seeds mlx's global random state (``spec.seed``), as any model built this way would.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    os.makedirs(folder, exist_ok=True)
    config = model_config(spec)
    mx.random.seed(spec.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(os.path.join(folder, "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    write_tokenizer(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    """``python -m spilld.tinymodel DIR``: write the tiny model into DIR and print its path (exit 2 on a bad DIR)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m spilld.tinymodel",
        description="Write a tiny random-weight llama and its byte-level tokenizer to a folder "
        "(mlx_lm.load and mlx_lm.server read it like a model from the hub; nothing is downloaded).",
    )
    parser.add_argument("dir", help="the folder to write (created if missing)")
    args = parser.parse_args(argv)
    folder = os.path.abspath(os.path.expanduser(args.dir))
    try:
        write_tiny_model(folder)
    except OSError as exc:
        print(f"spilld.tinymodel: cannot write {folder}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
