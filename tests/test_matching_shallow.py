"""A lookup compares the entries that leave the prompt's chain inside a block, not only those naming its last block
(found in review): when every entry naming the deeper blocks is unusable (a ring that wrapped, a front trimmed
past the match), the longest usable prefix still wins, and a restore of it loads that prefix's rows.

Real Stores on a tmp folder, blocks of ``B`` = 16 tokens, real mlx-lm caches whose rows are a function of the
prefix (tests/blocks_corpus.py): a KV cache, cut into blocks, beside a cache that is not (so no entry is
``whole`` and no hit comes from blocks alone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld.entries import Hit, Miss, MissReason
from spilld.matching import Query
from spilld.store import Store
from tests.blocks_corpus import B, layer, prefix_rows, toks
from tests.caches import live, same
from tests.models import cache_arrays

IDENT = spilld.Identity("model-s", "cfg-s", "tok-s", "")
RING = 64  # the ring's size: an entry of more tokens has wrapped (untrimmable)


def model(tokens: list[int], side: str = "ring", *, front: bool = False) -> list[Any]:
    """A KV layer beside a ``side`` layer (a ring of ``RING``, or a chunked cache: ``front`` trims its front away,
    so no match short of its start position is reusable), each fed ``tokens`` in one prefill."""
    other = C.RotatingKVCache(max_size=RING, keep=4) if side == "ring" else C.ChunkedKVCache(chunk_size=8)
    other.update_and_fetch(*prefix_rows(tokens, salt=1))
    if front:
        other.maybe_trim_front()
    caches = [layer("kv", tokens), other]
    mx.eval(cache_arrays(caches))
    return caches


def lives(caches: list[Any]) -> list[Any]:
    out = [live(c) for c in caches]
    mx.eval(out)
    return out


def store(root: Path) -> Store:
    return Store(root, block_tokens=B, durability="none")


def restores(s: Store, hit: Hit, prompt: list[int], side: str) -> None:
    """The hit loads the rows of the prompt's first ``matched`` tokens, as a model fed only those holds them."""
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded), got
    assert got.tokens == prompt[: hit.matched]
    assert same(lives(got.caches), lives(model(prompt[: hit.matched], side)))


@pytest.mark.asyncio
@pytest.mark.parametrize("side", ["ring", "chunked"])
async def test_an_entry_leaving_the_chain_inside_a_block_beats_a_shorter_one(side: str, tmp_path: Path) -> None:
    """The prompt's chain runs 3 blocks deep, where only ``deep`` (unusable) names its last block; ``short`` ends
    on the chain's first block (16 tokens); ``mid`` names two blocks of it and leaves inside the third: it serves
    40 tokens. Before the fix ``mid`` was never compared: a hit of 16 tokens from ``short``."""
    s = store(tmp_path)
    sys_, x, y, z = toks(B, 100), toks(B, 200), toks(B, 300), toks(60, 400)
    short = [*sys_, *toks(4, 8000)]
    mid = [*sys_, *x, *y[:8], *toks(10, 7000)]  # 3 blocks, its third not the prompt's
    deep = [*sys_, *x, *y, *z]  # 108 tokens: the ring wrapped, or the chunked cache's front is at 100
    a = await s.put(short, model(short, side), IDENT)
    b = await s.put(mid, model(mid, side), IDENT)
    c = await s.put(deep, model(deep, side, front=side == "chunked"), IDENT)
    assert s.count == 3 and [len(s.entry_at(r.path).blocks) for r in (a, b, c)] == [1, 3, 6]
    unusable = s.entry_at(c.path)  # for any prompt sharing fewer than its 108 tokens
    assert (not unusable.trimmable) if side == "ring" else (unusable.trimmable and unusable.min_reusable > 60)
    prompt = [*sys_, *x, *y, *z[:10], 1]
    hit = s.lookup(IDENT, "", prompt)
    assert isinstance(hit, Hit) and hit.entry.path == b.path and hit.matched == 40 and not hit.blocks_only
    restores(s, hit, prompt, side)


@pytest.mark.asyncio
async def test_an_entry_leaving_the_chain_inside_a_block_serves_where_the_deeper_one_cannot(tmp_path: Path) -> None:
    """Only an untrimmable entry names the prompt's last block; the other leaves the chain inside its second
    block and serves the first 16 tokens. Before the fix: a miss (``untrimmable``)."""
    s = store(tmp_path)
    sys_, a_, b_ = toks(B, 100), toks(24, 5000), toks(84, 9000)
    short = [*sys_, *a_]  # 40 tokens: its ring not wrapped
    e = await s.put(short, model(short), IDENT)
    f = await s.put([*sys_, *b_], model([*sys_, *b_]), IDENT)  # 100 tokens: wrapped
    assert s.entry_at(e.path).trimmable and not s.entry_at(f.path).trimmable
    prompt = [*sys_, *b_[:40], 1, 2, 3, 4, 5]
    hit = s.lookup(IDENT, "", prompt)
    assert isinstance(hit, Hit) and hit.entry.path == e.path and hit.matched == B
    restores(s, hit, prompt, "ring")


@pytest.mark.asyncio
async def test_the_walk_back_stops_where_no_shallower_entry_could_serve_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries naming block i but not the next share fewer than (i + 1) * B tokens: a usable match at the last
    block compares nothing more; one found two blocks up ends the walk there (the entries under the first block,
    named by every conversation under it, are never compared)."""
    s = store(tmp_path)
    sys_ = toks(B, 100)
    convs = [[*sys_, *toks(B + 4, 1000 * (i + 2))] for i in range(5)]  # each names sys_ and one block of its own
    for conv in convs:
        await s.put(conv, model(conv), IDENT)
    mid = [*sys_, *toks(B, 200), *toks(8, 300), *toks(10, 7000)]
    b = await s.put(mid, model(mid), IDENT)
    deep = [*sys_, *toks(B, 200), *toks(B, 300), *toks(60, 400)]
    await s.put(deep, model(deep), IDENT)  # 108 tokens: wrapped
    compared: list[list[str]] = []
    real = Query._compare

    def spy(self: Query, found: Any, candidates: list[Any], limit: int, *rest: Any) -> None:
        compared.append(sorted(e.path for e in candidates))
        real(self, found, candidates, limit, *rest)

    monkeypatch.setattr(Query, "_compare", spy)
    hit = s.lookup(IDENT, "", [*deep[:58], 1])
    assert isinstance(hit, Hit) and hit.entry.path == b.path and hit.matched == 40
    assert compared[1:] == [[b.path]]  # the walk back compared mid alone, then stopped
    compared.clear()
    hit = s.lookup(IDENT, "", [*mid, 1])  # mid's own prompt: its last block is the chain's
    assert isinstance(hit, Hit) and hit.entry.path == b.path and hit.matched == len(mid)
    assert len(compared) == 1


@pytest.mark.asyncio
async def test_a_prompt_sharing_less_than_a_block_with_entries_with_blocks_is_served_by_them(tmp_path: Path) -> None:
    """No chain reaches an entry with blocks whose first block the prompt does not hold whole: one sharing fewer
    than ``B`` tokens with it, or one of at most ``B`` tokens. The entry can still be cut to what they share.
    Before the fix each such lookup was a miss (``no_entry``), though a cut of the entry served it; entries without
    blocks were found (the first-token index)."""
    s = store(tmp_path)
    conv = toks(40, 100)  # two blocks and a tail: its ring (64) has not wrapped, so it can be cut
    e = await s.put(conv, model(conv), IDENT)
    wrapped = [*conv[:B], *toks(84, 9000)]  # shares conv's first block; its ring wrapped: it cannot be cut
    f = await s.put(wrapped, model(wrapped), IDENT)
    assert s.entry_at(e.path).trimmable and not s.entry_at(f.path).trimmable
    assert s.entry_at(e.path).blocks[0] == s.entry_at(f.path).blocks[0]
    for prompt, matched in [
        ([*conv[:10], *toks(20, 7000)], 10),  # leaves both inside their first block
        (conv[:B], B - 1),  # a prompt that is exactly one block: one token is left to compute
        (conv[:5], 4),  # a prompt shorter than a block
    ]:
        hit = s.lookup(IDENT, "", prompt)
        assert isinstance(hit, Hit) and hit.entry.path == e.path and hit.matched == matched, (len(prompt), hit)
        assert not hit.blocks_only
        restores(s, hit, prompt, "ring")
    assert isinstance(s.lookup(IDENT, "", [*conv[: B + 3], 1]), Hit)  # one past a block: its chain, as before
    s.remove_where(lambda x: x.path == e.path)
    miss = s.lookup(IDENT, "", [*conv[:10], 1])  # only the one that cannot be cut shares them: it serves none
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY
    assert s.index.heads == {}  # nothing of them is left in the index (the one that cannot be cut was never in)


@pytest.mark.asyncio
async def test_a_prompt_under_a_block_compares_only_the_first_blocks_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many entries start alike and part inside their first block: the one sharing the most with the prompt serves
    it, found among its neighbours in token order, not by comparing every entry. One whose front was trimmed (a
    chunked cache: no cut short of 16 tokens) is passed over for the next best."""
    s = store(tmp_path)
    rng = np.random.default_rng(3)
    stored = [[7, *rng.integers(0, 3, size=B + 3).tolist()] for _ in range(40)]  # 40 first blocks of 3 symbols
    for t in stored:
        await s.put(t, model(t), IDENT)
    space = (s.entries[0].fingerprint, "", s.entries[0].codec_provider)
    assert len(s.index.heads[space].groups) > 30
    again = store(tmp_path)  # a restart: the scan adds every entry unsorted and sorts the order once (review)
    again.scan()
    assert again.index.heads[space].order == s.index.heads[space].order == sorted(s.index.heads[space].order)
    s = again
    looked: list[int] = []
    real = Query._first_usable

    def spy(found: Any, group: list[Any], shared: int) -> None:
        looked.append(shared)
        real(found, group, shared)

    monkeypatch.setattr(Query, "_first_usable", staticmethod(spy))
    for _ in range(20):
        prompt = [7, *rng.integers(0, 3, size=int(rng.integers(1, 2 * B))).tolist()]
        best = max(min(len(common(t, prompt)), len(prompt) - 1) for t in stored)
        looked.clear()
        hit = s.lookup(IDENT, "", prompt)
        if best >= B:  # its chain: compared as before
            assert isinstance(hit, Hit) and hit.matched >= best
            continue
        assert isinstance(hit, Hit) and hit.matched == best and len(looked) <= 3, (best, hit, looked)
        assert s.entry_at(hit.entry.path).tokens[:best].tolist() == prompt[:best]
    front = [7, 9, 9, 9, *toks(30, 500)]  # the only entry starting 7, 9, 9, 9: its front is gone (min_reusable 16)
    await s.put(front, model(front, "chunked", front=True), IDENT)
    assert s.entry_at(s.entries[-1].path).min_reusable > 4
    hit = s.lookup(IDENT, "", [7, 9, 9, 9, 5, 5])
    assert isinstance(hit, Hit) and hit.matched == 1  # the shared 7 of another entry: the chunked one cannot cut to 4


def common(a: list[int], b: list[int]) -> list[int]:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]
