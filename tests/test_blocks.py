"""Format v2's prefix blocks (issue 14): shared prefixes stored once, a divergence inside a block, exact restores
from blocks and a tail or from blocks alone for every cache class, orphans reclaimed, eviction over unique bytes,
hostile blocks and manifests, the daemon's path, and v1 files beside v2 ones.

Every store here cuts blocks of ``B`` = 16 tokens (the smallest a store takes), so caches stay small. Caches come
from real mlx-lm cache objects (tests/blocks_corpus.py) and, where next-step logits are compared, from tiny
random-weight models (tests/models.py), each comparison with a negative control that shows it can fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import spilld
from spilld import blocks, errors, fileio
from spilld import format as fmt
from spilld.blocks import BLOCK_EXT, positional_slots
from spilld.client import AsyncClient
from spilld.entries import Hit, Miss, MissReason, identity_fingerprint, namespace_hash
from spilld.loader import read_header
from spilld.saver import Attachment, plan
from spilld.store import Store
from spilld.validate import header_from_bytes
from tests.blocks_corpus import (
    MODEL_CASES,
    B,
    as_v1,
    as_version,
    blocks_on_disk,
    conversation,
    copy_to,
    disk_bytes,
    entry_name,
    key_of,
    manifests_on_disk,
    prefill,
    quarantined,
    rewrite,
    toks,
)
from tests.caches import live, same
from tests.daemons import Daemon, cleanup, new_root
from tests.golden_cases import GOLDEN, GOLDEN_TOKENS
from tests.models import next_logits, random_tokens, tiny_llama
from tests.test_store import flip

IDENT = spilld.Identity("model-b", "cfg-b", "tok-b", "")
OTHER = spilld.Identity("model-o", "cfg-o", "tok-o", "")
GOLDEN_IDENT = spilld.Identity("golden", "fp-golden", "tok-golden", "ns")
V1 = os.path.join(os.path.dirname(__file__), "data", "v1")
CUT = {"kv", "quantized", "concat"}  # the kinds whose rows are cut into blocks (also inside a CacheList)


def store(root: Path | str, **kw: Any) -> Store:
    return Store(root, block_tokens=B, durability="none", **kw)


def rescanned(root: Path | str) -> Store:
    s = store(root)
    s.scan()
    return s


def lives(caches: list[Any]) -> list[Any]:
    out = [live(c) for c in caches]
    mx.eval(out)
    return out


def restored(s: Store, ident: spilld.Identity, prompt: list[int]) -> spilld.Loaded:
    hit = s.lookup(ident, ident.namespace, prompt)
    assert isinstance(hit, Hit), hit
    got = s.restore(hit, ident)
    assert isinstance(got, spilld.Loaded), got
    return got


def keys(path: str) -> list[bytes]:
    b = read_header(path).blocks
    assert b is not None and b.size == B
    return b.keys


def block_file(s: Store, key: bytes) -> str:
    p = s.block_path(key)
    assert p is not None
    return p


def leaves(entries: list[fmt.CacheEntry]) -> list[fmt.CacheEntry]:
    return [x for e in entries for x in ([e] if not e.children else leaves(e.children))]


def logits_equal(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


# --- 1. shared prefixes stored once ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_shared_prefix_blocks_are_stored_once(tmp_path: Path) -> None:
    system = toks(3 * B)  # a system prompt of three blocks
    convs = [[*system, *toks(20, start=2000 + 100 * i)] for i in range(3)]  # four blocks and four tail rows each
    s = store(tmp_path)
    a = await s.put(convs[0], conversation(convs[0]), IDENT)
    b = await s.put(convs[1], conversation(convs[1]), IDENT)
    ka, kb = keys(a.path), keys(b.path)
    assert len(ka) == len(kb) == 4
    assert ka[:3] == kb[:3] and ka[3] != kb[3]  # the same three block files, then each its own
    on_disk = blocks_on_disk(str(tmp_path))
    assert sorted(map(key_of, on_disk)) == sorted({*ka, *kb}) and len(on_disk) == 5
    st = s.stats()
    assert (st["blocks"], st["blocks_written"], st["blocks_reused"]) == (5, 5, 3)
    assert st["block_bytes"] == sum(os.path.getsize(p) for p in on_disk)
    assert st["bytes"] == disk_bytes(str(tmp_path))  # each block once

    # a third conversation with the same system prompt writes only its own block and its manifest
    c = await s.put(convs[2], conversation(convs[2]), IDENT)
    kc = keys(c.path)
    after = s.stats()
    assert kc[:3] == ka[:3]
    assert after["blocks_written"] - st["blocks_written"] == 1
    assert after["blocks_reused"] - st["blocks_reused"] == 3
    assert after["bytes_written"] - st["bytes_written"] == c.file_bytes + os.path.getsize(block_file(s, kc[3]))
    assert len(blocks_on_disk(str(tmp_path))) == 6 and len(manifests_on_disk(str(tmp_path))) == 3

    # a restart finds the same, and each conversation restores exactly its own rows
    s2 = rescanned(tmp_path)
    assert s2.count == 3 and s2.stats()["blocks"] == 6 and s2.total_bytes == disk_bytes(str(tmp_path))
    for conv in convs:
        got = restored(s2, IDENT, [*conv, 1])
        assert got.tokens == conv
        assert same(lives(got.caches), lives(conversation(conv)))


@pytest.mark.asyncio
async def test_a_chat_turn_writes_only_its_new_blocks(tmp_path: Path) -> None:
    turn1 = toks(40)  # two blocks and eight tail rows
    turn2 = [*turn1, *toks(30, start=3000)]  # 70 tokens: four blocks, the first two turn 1's
    s = store(tmp_path)
    k1 = keys((await s.put(turn1, conversation(turn1), IDENT)).path)
    r2 = await s.put(turn2, conversation(turn2), IDENT)
    assert keys(r2.path)[:2] == k1
    st = s.stats()
    assert (st["blocks_written"], st["blocks_reused"], st["superseded"]) == (4, 2, 1)
    assert manifests_on_disk(str(tmp_path)) == [r2.path]  # turn 1 superseded, its blocks kept: turn 2 names them
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path)))) == sorted(keys(r2.path))
    # turn 1 comes back from turn 2's blocks, cut inside its third block
    got = restored(s, IDENT, [*turn1, 5])
    assert got.tokens == turn1 and same(lives(got.caches), lives(conversation(turn1)))
    got = restored(s, IDENT, [*turn2, 5])
    assert got.tokens == turn2 and same(lives(got.caches), lives(conversation(turn2)))


# --- 2. a divergence inside a block ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_divergence_inside_a_block_stores_that_block_twice(tmp_path: Path) -> None:
    model = tiny_llama()
    ident = spilld.model_identity(model, model_id="llama")
    prefix = random_tokens(40, seed=1)  # two and a half blocks: the prompts part inside the third
    a, b = [*prefix, *random_tokens(12, seed=2)], [*prefix, *random_tokens(12, seed=3)]
    live_a = prefill(model, make_prompt_cache, prefix, a[40:])
    live_b = prefill(model, make_prompt_cache, prefix, b[40:])
    s = store(tmp_path)
    ra, rb = await s.put(a, live_a, ident), await s.put(b, live_b, ident)
    ka, kb = keys(ra.path), keys(rb.path)
    assert len(ka) == len(kb) == 3
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path)))) == sorted({*ka, *kb})  # four files
    s = rescanned(tmp_path)
    for conv, other in ((a, b), (b, a)):
        got = restored(s, ident, [*conv, 7])
        assert got.tokens == conv
        live_cache = prefill(model, make_prompt_cache, prefix, conv[40:])
        assert same(lives(got.caches), lives(live_cache))
        want = next_logits(model, live_cache, 7)
        assert logits_equal(next_logits(model, got.caches, 7), want)
        # the negative control: the other conversation (its third block differs) gives other logits
        assert not logits_equal(next_logits(model, prefill(model, make_prompt_cache, prefix, other[40:]), 7), want)


# --- 3. restores exact for every cache class ------------------------------------------------------


def _check_cut(manifest: fmt.Header, whole: fmt.Header, tail: int) -> None:
    """The manifest's positional caches hold the rows after the blocks; every other cache is stored whole."""
    cut = [e for e in leaves(manifest.caches) if e.kind in CUT]
    assert (manifest.blocks is not None) == bool(cut)
    for m, w in zip(leaves(manifest.caches), leaves(whole.caches), strict=True):
        assert (m.kind, m.offset) == (w.kind, w.offset)
        if m.kind in CUT:
            assert [s.shape[-2] for s in m.tensors] == [tail] * len(m.tensors)
            assert [s.shape[-2] for s in w.tensors] == [tail + 2 * B] * len(w.tensors)
        else:
            assert [(s.shape, s.dtype) for s in m.tensors] == [(s.shape, s.dtype) for s in w.tensors]


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(MODEL_CASES))
async def test_restore_from_blocks_and_tail_gives_the_live_logits(name: str, tmp_path: Path) -> None:
    build, factory, _ = MODEL_CASES[name]
    model = build()
    ident = spilld.model_identity(model, model_id=name)
    prefix, rest = random_tokens(2 * B, seed=1), random_tokens(12, seed=2)
    cache = prefill(model, factory, prefix, rest)
    r = await store(tmp_path / "s").put([*prefix, *rest], cache, ident)
    whole = spilld.save(tmp_path / "whole.spilld", [*prefix, *rest], cache, durability="none").header
    manifest = read_header(r.path)
    _check_cut(manifest, whole, len(rest))
    if manifest.blocks is not None:
        assert len(manifest.blocks.keys) == 2
    s = rescanned(tmp_path / "s")  # a restart in between
    got = restored(s, ident, [*prefix, *rest, 5])
    assert got.tokens == [*prefix, *rest] and [type(c) for c in got.caches] == [type(c) for c in cache]
    want = next_logits(model, cache, 5)
    assert logits_equal(next_logits(model, got.caches, 5), want)
    # the negative control: other rows in the blocks alone (another first block, the same tail tokens)
    control = prefill(model, factory, random_tokens(2 * B, seed=9), rest)
    assert not logits_equal(next_logits(model, control, 5), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(MODEL_CASES))
async def test_a_prompt_sharing_only_whole_blocks_restores_from_them(name: str, tmp_path: Path) -> None:
    """A new conversation that shares only the first two blocks of a stored one. A trimmable entry is cut to
    them; one that cannot be cut (an attachment) is restored from its blocks alone (``blocks_only``), which
    needs every cache positional: any other layout is a miss, never a wrong prefix."""
    build, factory, positional = MODEL_CASES[name]
    model = build()
    ident = spilld.model_identity(model, model_id=name)
    prefix, rest, new = random_tokens(2 * B, seed=1), random_tokens(12, seed=2), random_tokens(8, seed=4)
    want = next_logits(model, prefill(model, factory, prefix), new[0])

    plain = store(tmp_path / "plain")
    await plain.put([*prefix, *rest], prefill(model, factory, prefix, rest), ident)
    hit = plain.lookup(ident, "", [*prefix, *new])
    if isinstance(hit, Hit):  # every layout whose caches can all be cut back to the prefix
        assert hit.matched == 2 * B
        got = plain.restore(hit, ident)
        assert isinstance(got, spilld.Loaded) and got.tokens == prefix
        assert logits_equal(next_logits(model, got.caches, new[0]), want)
    else:
        assert not positional and hit.reason is MissReason.UNTRIMMABLE

    att = Attachment("draft", {"n": 1}, [mx.arange(6, dtype=mx.float32).reshape(2, 3)])
    s = store(tmp_path / "attached")
    stored_cache = prefill(model, factory, prefix, rest)
    r = await s.put([*prefix, *rest], stored_cache, ident, attachments=[att])
    hit = s.lookup(ident, "", [*prefix, *new])
    if not positional:
        assert isinstance(hit, Miss) and hit.reason is MissReason.UNTRIMMABLE
        return
    assert isinstance(hit, Hit) and hit.blocks_only and hit.matched == 2 * B and hit.entry.path == r.path
    flip(r.path, read_header(r.path).data_start)  # the manifest's own rows: a restore from blocks never reads them
    got = s.restore(hit, ident)
    assert isinstance(got, spilld.Loaded), got
    assert got.tokens == prefix and got.attachments == [] and got.checkpoint is None
    assert logits_equal(next_logits(model, got.caches, new[0]), want)
    # the negative control: the stored conversation's whole cache (its own rows past the prefix) differs
    assert not logits_equal(next_logits(model, stored_cache, new[0]), want)
    # and the flipped byte is read by a restore of the whole entry: a miss, the manifest quarantined
    miss = s.restore(Hit(hit.entry, len(prefix) + len(rest)), ident)
    assert isinstance(miss, Miss) and miss.reason is MissReason.CORRUPT


@pytest.mark.asyncio
@pytest.mark.parametrize("whole_first", [True, False])
async def test_blocks_alone_serve_whatever_order_layouts_sharing_their_leaves_were_indexed(
    whole_first: bool, tmp_path: Path
) -> None:
    """A whole entry (one KV layer) that cannot be cut (an attachment) and an entry of a layout that is not whole
    (a recurrent state beside a KV layer of the same shape) share a root: the root hashes the positional leaves
    only. The whole entry's blocks serve a prompt that leaves it in its third block, whichever was indexed last,
    and after a restart (whose scan indexes them in the folder's order). Found in review: the layout was marked
    whole or not by the last manifest indexed, so the second order missed (``untrimmable``)."""
    stored, other = toks(40), toks(20, start=5000)
    att = Attachment("draft", {"n": 1}, [mx.zeros((2, 2))])
    puts = [(stored, ("kv",), [att]), (other, ("arrays", "kv"), [])]
    s = store(tmp_path)
    for tokens, kinds, atts in puts if whole_first else puts[::-1]:
        await s.put(tokens, conversation(tokens, kinds), IDENT, attachments=atts)
    whole = [e for e in s.entries if e.whole]
    assert len(whole) == 1 and whole[0].ntokens == 40 and not whole[0].trimmable
    assert len({blocks.header_root(read_header(e.path), B) for e in s.entries}) == 1  # one layout, as far as keys go
    prompt = [*stored[:36], *toks(5, start=7000)]
    for got in (s, rescanned(tmp_path)):
        hit = got.lookup(IDENT, "", prompt)
        assert isinstance(hit, Hit), hit
        assert hit.blocks_only and hit.matched == 2 * B and hit.entry.path == whole[0].path
        loaded = got.restore(hit, IDENT)
        assert isinstance(loaded, spilld.Loaded) and loaded.tokens == stored[: 2 * B]
        assert same(lives(loaded.caches), lives(conversation(stored[: 2 * B], ("kv",))))


LAYOUTS = [
    ("kv", "kv"),
    ("quantized",),
    ("concat",),
    ("list",),
    ("hybrid_list",),
    ("rotating", "kv"),
    ("arrays", "kv"),
    ("chunked", "kv"),
    ("arrays",),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("kinds", LAYOUTS, ids=["-".join(k) for k in LAYOUTS])
async def test_every_layout_is_cut_where_positional_and_restores_exactly(
    kinds: tuple[str, ...], tmp_path: Path
) -> None:
    """Without a model: CacheList of KV caches among them (its children cut into blocks), the exact state
    compared, the full entry and a prefix of two whole blocks."""
    tokens = toks(40)
    caches = conversation(tokens, kinds)
    r = await store(tmp_path / "s").put(tokens, caches, IDENT)
    whole = spilld.save(tmp_path / "whole.spilld", tokens, caches, durability="none").header
    _check_cut(read_header(r.path), whole, 40 - 2 * B)
    s = rescanned(tmp_path / "s")
    got = restored(s, IDENT, [*tokens, 1])
    assert same(lives(got.caches), lives(caches))
    hit = s.lookup(IDENT, "", [*tokens[: 2 * B], 7, 7])
    if isinstance(hit, Miss):  # a ring that wrapped, a recurrent state: not cut back
        assert hit.reason is MissReason.UNTRIMMABLE and {"rotating", "arrays", "hybrid_list"} & set(kinds)
        return
    got2 = s.restore(hit, IDENT)
    assert isinstance(got2, spilld.Loaded) and got2.tokens == tokens[: 2 * B]
    assert same(lives(got2.caches), lives(conversation(tokens[: 2 * B], kinds)))


# --- 4. orphans reclaimed, missing blocks quarantined ---------------------------------------------


async def _two_sharing(s: Store) -> tuple[str, str, list[int], list[int]]:
    """Two entries sharing two blocks; each has a third block of its own and four tail rows."""
    a, b = [*toks(2 * B), *toks(20, start=5000)], [*toks(2 * B), *toks(20, start=6000)]
    ra = await s.put(a, conversation(a), IDENT)
    rb = await s.put(b, conversation(b), IDENT)
    return ra.path, rb.path, a, b


@pytest.mark.asyncio
async def test_blocks_of_a_manifest_removed_by_hand_are_reclaimed(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, pb, _, b = await _two_sharing(s)
    own_a = block_file(s, keys(pa)[2])
    os.unlink(pa)
    s2 = rescanned(tmp_path)
    assert s2.stats()["blocks_reclaimed"] == 1 and s2.count == 1
    assert not os.path.exists(own_a)
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path)))) == sorted(keys(pb))  # named blocks survive
    assert s2.total_bytes == disk_bytes(str(tmp_path))
    got = restored(s2, IDENT, [*b, 1])
    assert same(lives(got.caches), lives(conversation(b)))


@pytest.mark.asyncio
async def test_blocks_written_before_a_crash_took_their_manifest_are_reclaimed(tmp_path: Path) -> None:
    s = store(tmp_path / "first")
    pa, _, _, _ = await _two_sharing(s)
    fresh = tmp_path / "fresh"
    folder = os.path.dirname(pa).replace(str(tmp_path / "first"), str(fresh))
    for p in blocks_on_disk(str(tmp_path / "first")):  # what a crash between the blocks and the manifest leaves
        copy_to(p, folder)
    s2 = rescanned(fresh)
    assert s2.count == 0 and s2.stats()["blocks_reclaimed"] == 4 and s2.stats()["blocks"] == 0
    assert blocks_on_disk(str(fresh)) == [] and s2.total_bytes == 0


@pytest.mark.asyncio
async def test_a_manifest_whose_block_is_missing_is_quarantined_and_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    os.unlink(block_file(s, keys(pa)[2]))
    with pytest.raises(errors.BlockMissing) as exc:
        spilld.load(pa)  # blocks found beside it: the one it names is not there
    assert exc.value.code == "block_missing"
    with caplog.at_level(logging.WARNING, logger="spilld.store"):
        s2 = rescanned(tmp_path)
    assert any("blocks are not on disk" in r.getMessage() and pa in r.getMessage() for r in caplog.records)
    assert s2.count == 1 and s2.entry_at(pa) is None and s2.stats()["quarantined"] == 1
    assert [q.split("-", 1)[1] for q in quarantined(str(tmp_path))] == [os.path.basename(pa)]
    assert not os.path.exists(pa)
    hit = s2.lookup(IDENT, "", [*a, 1])  # at most the prefix it shares with the other entry, from that one
    assert isinstance(hit, Hit) and hit.entry.path == pb and hit.matched == 2 * B
    got = s2.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded) and same(lives(got.caches), lives(conversation(a[: 2 * B])))
    assert same(lives(restored(s2, IDENT, [*b, 1]).caches), lives(conversation(b)))


@pytest.mark.asyncio
@pytest.mark.parametrize("fails", ["manifest", "block"])
async def test_a_file_unreadable_at_a_scan_costs_no_stored_entry(
    tmp_path: Path, fails: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest (or a block) that cannot be read at a start (EMFILE, EIO: left alone) must not make the scan take
    the manifest's blocks for orphans, nor the manifest for one whose block is missing (found in review: the
    blocks were removed, and the next start quarantined the good manifest)."""
    from spilld.store import scan as scanning

    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    s.close()
    victim = pa if fails == "manifest" else block_file(s, keys(pa)[2])
    real_header, real_stat = scanning.read_own_header, os.stat

    def header(path: str, *args: Any, **kw: Any) -> Any:
        if path == victim:
            raise errors.StorageError("open: Too many open files", path=path)
        return real_header(path, *args, **kw)

    def stat(path: Any, *args: Any, **kw: Any) -> Any:
        if os.fspath(path) == victim:
            raise OSError(5, "Input/output error")
        return real_stat(path, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(scanning, "read_own_header", header)
        m.setattr(scanning.os, "stat", stat)
        flaky = rescanned(tmp_path)
    assert flaky.stats()["blocks_reclaimed"] == 0 and flaky.stats()["quarantined"] == 0
    assert flaky.entry_at(pb) is not None  # the rest of the folder is served
    assert same(lives(restored(flaky, IDENT, [*b, 1]).caches), lives(conversation(b)))
    # and its eviction leaves the blocks it shares with the entry that could not be read (found in review)
    assert flaky.remove_where(lambda e: e.path == pb) == 1
    flaky.close()
    s2 = rescanned(tmp_path)  # the file reads again: its entry is whole
    assert s2.count == 1 and s2.stats()["quarantined"] == 0
    assert same(lives(restored(s2, IDENT, [*a, 1]).caches), lives(conversation(a)))


@pytest.mark.asyncio
async def test_a_block_removed_while_running_takes_its_manifest_out(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, _, a, _ = await _two_sharing(s)
    os.unlink(block_file(s, keys(pa)[2]))
    hit = s.lookup(IDENT, "", [*a, 1])
    assert isinstance(hit, Hit) and hit.entry.path == pa
    assert isinstance(s.restore(hit, IDENT), Miss)
    again = s.lookup(IDENT, "", [*a, 1])
    assert not (isinstance(again, Hit) and again.entry.path == pa)  # not offered again


@pytest.mark.asyncio
@pytest.mark.parametrize("stray", ["first", "last"])
async def test_a_misnamed_copy_of_a_block_never_costs_a_stored_entry_its_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stray: str
) -> None:
    """Found in review: of two files under one block key, the scan kept whichever was listed first, unread, and
    removed the other; a file of another block under that name, listed first, cost a stored entry its block (the
    restore found the wrong block and removed the entry). Now the copies' headers are read: the real block is
    kept, the misnamed file quarantined, a good spare copy removed, whatever the order they are listed in."""
    from spilld.store import scan as scanning

    s = store(tmp_path)
    pa, pb, a, _ = await _two_sharing(s)
    ka, kb = keys(pa)[2], keys(pb)[2]  # each entry's own third block
    genuine = block_file(s, ka)
    misnamed = os.path.join(os.path.dirname(genuine), f"{ka.hex()}-00000000{BLOCK_EXT}")
    shutil.copy(block_file(s, kb), misnamed)
    spare = os.path.join(os.path.dirname(genuine), f"{ka.hex()}-ffffffff{BLOCK_EXT}")  # two puts wrote it
    shutil.copy(genuine, spare)
    real = scanning.folder_names

    def listed(folder: str) -> list[str]:  # the misnamed file listed first or last, whatever the filesystem does
        names = sorted(real(folder), key=lambda n: n == os.path.basename(misnamed))
        return names[::-1] if stray == "first" else names

    with monkeypatch.context() as m:
        m.setattr(scanning, "folder_names", listed)
        again = rescanned(tmp_path)
    assert same(lives(restored(again, IDENT, [*a, 1]).caches), lives(conversation(a)))  # the stored entry is whole
    assert again.count == 2 and again.stats()["quarantined"] == 1 and not os.path.exists(misnamed)
    assert [os.path.exists(genuine), os.path.exists(spare)].count(True) == 1


# --- 5. eviction and the cap count unique bytes ---------------------------------------------------


@pytest.mark.asyncio
async def test_the_disk_cap_counts_each_block_once(tmp_path: Path) -> None:
    probe = store(tmp_path / "probe")
    await _two_sharing(probe)
    unique = probe.total_bytes
    assert unique == disk_bytes(str(tmp_path / "probe"))
    per_manifest = sum(e.nbytes + sum(os.path.getsize(block_file(probe, k)) for k in e.blocks) for e in probe.entries)
    assert per_manifest > unique  # counted per manifest, the shared blocks would not fit

    fits = store(tmp_path / "fits", disk_cap=unique)
    await _two_sharing(fits)
    assert fits.count == 2 and fits.counters.evicted == 0

    tight = store(tmp_path / "tight", disk_cap=unique - 1)
    pa, pb, _, b = await _two_sharing(tight)
    assert tight.counters.evicted == 1 and tight.entry_at(pa) is None and not os.path.exists(pa)
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path / "tight")))) == sorted(keys(pb))  # the shared stay
    assert tight.total_bytes == disk_bytes(str(tmp_path / "tight")) <= tight.disk_cap
    assert same(lives(restored(tight, IDENT, [*b, 1]).caches), lives(conversation(b)))


@pytest.mark.asyncio
async def test_evicting_removes_only_the_blocks_no_manifest_names(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, pb, _, b = await _two_sharing(s)
    shared, own_a, own_b = keys(pa)[:2], keys(pa)[2], keys(pb)[2]
    assert s.remove_where(lambda e: e.path == pa) == 1
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path)))) == sorted([*shared, own_b])
    assert own_a not in {x.key for x in s.blocks} and s.stats()["blocks_reclaimed"] == 1
    assert s.total_bytes == disk_bytes(str(tmp_path))
    assert same(lives(restored(s, IDENT, [*b, 1]).caches), lives(conversation(b)))
    unlinked: list[str] = []

    class Recorded(fileio.FileOps):
        def unlink(self, path: str) -> None:
            unlinked.append(path)
            super().unlink(path)

    s.ops = Recorded()
    assert s.remove_where(lambda e: e.path == pb) == 1  # the last one: every block goes
    assert blocks_on_disk(str(tmp_path)) == [] and manifests_on_disk(str(tmp_path)) == []
    # the manifest first: a crash between the unlinks must never leave it naming a block that is gone
    assert unlinked[0] == pb and len(unlinked) == 4 and all(p.endswith(BLOCK_EXT) for p in unlinked[1:])
    st = s.stats()
    assert (st["blocks"], st["block_bytes"], st["bytes"], st["blocks_reclaimed"]) == (0, 0, 0, 4)


# --- 6. hostile blocks and manifests: a typed error, a miss, never wrong rows --------------------


def _refused(s: Store, ident: spilld.Identity, prompt: list[int], path: str) -> str:
    """The code a restore of the entry at ``path`` fails with; the restore is then a miss."""
    hit = s.lookup(ident, ident.namespace, prompt)
    assert isinstance(hit, Hit) and hit.entry.path == path, hit
    with pytest.raises(errors.FileFormatError) as exc:
        s.read_hit(hit, ident)
    miss = s.restore(hit, ident)
    assert isinstance(miss, Miss) and miss.reason is MissReason.CORRUPT
    return exc.value.code


def _tokens_changed(w: dict[str, Any]) -> None:
    t = fmt.decode_tokens(w["tokens"])
    w["tokens"] = fmt.encode_tokens([t[0] + 1, *t[1:]])


def _identity_changed(w: dict[str, Any]) -> None:
    w["identity"]["model_id"] = "another-model"


def _layout_changed(w: dict[str, Any]) -> None:
    slot = w["caches"][0]["tensors"][0]  # the same bytes read as f16 rows twice as wide
    slot["dtype"], slot["shape"] = "float16", [*slot["shape"][:-1], slot["shape"][-1] * 2]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("index", "edit", "code"),
    [
        (1, _tokens_changed, "block_key_mismatch"),  # its key is no longer the hash of its tokens
        (2, _identity_changed, "block_invalid"),  # a block of another identity, chained right
        (0, _identity_changed, "block_key_mismatch"),  # block 0 of another identity: another root key
        (2, _layout_changed, "block_invalid"),  # a block of another layout
    ],
    ids=["tokens", "identity", "identity-block0", "layout"],
)
async def test_a_hostile_block_is_refused_and_quarantined(
    index: int, edit: Callable[[dict[str, Any]], None], code: str, tmp_path: Path
) -> None:
    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    third = toks(40, start=9000)
    await s.put(third, conversation(third), IDENT)
    bad = rewrite(block_file(s, keys(pa)[index]), edit)
    assert _refused(s, IDENT, [*a, 1], pa) == code
    assert os.path.basename(bad) in [q.split("-", 1)[1] for q in quarantined(str(tmp_path))]
    named_by_b = keys(pa)[index] in keys(pb)
    assert s.entry_at(pa) is None and (s.entry_at(pb) is None) == named_by_b  # every manifest naming it is out

    def check(st: Store) -> None:
        for conv, path in ((a, pa), (b, pb)):
            if path == pa or named_by_b:  # nothing of the bad block is served
                again = st.lookup(IDENT, "", [*conv, 1])
                assert not (isinstance(again, Hit) and again.entry.path == path)
            else:
                assert same(lives(restored(st, IDENT, [*conv, 1]).caches), lives(conversation(conv)))
        assert same(lives(restored(st, IDENT, [*third, 1]).caches), lives(conversation(third)))

    check(s)
    check(rescanned(tmp_path))  # after a restart too


def _rank_zero(w: dict[str, Any]) -> None:
    slot = w["caches"][0]["tensors"][0]  # one element: its byte count still right for its shape
    slot["shape"], slot["bytes"] = [], fmt.DTYPE_SIZES[slot["dtype"]]


def _bytes_field_name(w: dict[str, Any]) -> None:
    w["caches"][0]["fields"] |= {"step": 1, b"step": 2}  # a text and a bytes name: no order between them


def _deep_field_value(w: dict[str, Any]) -> None:
    deep: Any = 0
    for _ in range(1020):  # within msgpack's 1,024 levels as a header, past them once packed into the root key
        deep = [deep]
    w["caches"][0]["fields"] |= {"x": deep}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (_rank_zero, "tensor_rank_mismatch"),
        (_bytes_field_name, "header_malformed"),
        (_deep_field_value, "nesting_too_deep"),  # found in review: a ValueError that stopped a restart's scan
    ],
    ids=["rank-0", "bytes-field-name", "deep-field-value"],
)
async def test_a_hostile_manifest_layout_is_refused_by_every_reader(
    edit: Callable[[dict[str, Any]], None], code: str, tmp_path: Path
) -> None:
    """A manifest's block keys hash its layout (each tensor's width, its fields in order) before the codec rules
    run: a layout that cannot be hashed is a typed refusal for the loader, the scan, `spilld ls` and the scrub,
    never an exception that stops them (found in review: IndexError and TypeError stopped a restart's scan)."""
    from spilld import scrub
    from spilld.store.listing import list_entries

    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    rewrite(pa, edit)
    bad = copy_to(pa, os.path.dirname(pa), entry_name())  # a second bad one, for the scrub and the restart's scan
    assert _refused(s, IDENT, [*a, 1], pa) == code
    with pytest.raises(errors.FileFormatError) as exc:
        scrub.check_manifest(bad)
    assert exc.value.code == code
    assert [r["path"] for r in list_entries(str(tmp_path))] == [pb]
    again = rescanned(tmp_path)  # the scan goes on past it: the bad one quarantined, the good one served
    assert again.entry_at(bad) is None and not os.path.exists(bad)
    assert os.path.basename(bad) in [q.split("-", 1)[1] for q in quarantined(str(tmp_path))]
    assert same(lives(restored(again, IDENT, [*b, 1]).caches), lives(conversation(b)))


@pytest.mark.asyncio
async def test_a_block_whose_bytes_flipped_is_a_miss_and_only_its_manifests_go(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    own = block_file(s, keys(pa)[2])
    flip(own, read_header(own).data_start + 3)
    hit = s.lookup(IDENT, "", [*a, 1])
    assert isinstance(hit, Hit) and hit.entry.path == pa
    with pytest.raises(errors.TensorHashMismatch) as exc:
        s.read_hit(hit, IDENT)
    assert exc.value.code == "tensor_hash_mismatch" and exc.value.path == own
    miss = await s.restore_async(hit, IDENT)  # the daemon's path: the quarantine and unlinks off the loop
    assert isinstance(miss, Miss) and miss.reason is MissReason.CORRUPT
    assert s.entry_at(pa) is None and not os.path.exists(pa) and not os.path.exists(own)
    assert [q.split("-", 1)[1] for q in quarantined(str(tmp_path))] == [os.path.basename(own)]
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path)))) == sorted(keys(pb))  # the shared blocks stay
    assert same(lives(restored(s, IDENT, [*b, 1]).caches), lives(conversation(b)))


@pytest.mark.asyncio
async def test_the_bytes_counted_stay_right_after_a_bad_block(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, _, a, _ = await _two_sharing(s)
    own = block_file(s, keys(pa)[2])
    flip(own, read_header(own).data_start + 3)
    hit = s.lookup(IDENT, "", [*a, 1])
    assert isinstance(hit, Hit)
    assert isinstance(await s.restore_async(hit, IDENT), Miss)
    assert s.stats()["block_bytes"] == sum(x.nbytes for x in s.blocks)
    assert s.total_bytes == disk_bytes(str(tmp_path))


@pytest.mark.asyncio
async def test_a_manifest_naming_blocks_it_does_not_match_is_refused(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    # a self-consistent block (B's third) filed under the key A's manifest names: B's rows are never served for A
    shutil.copyfile(block_file(s, keys(pb)[2]), block_file(s, keys(pa)[2]))
    assert _refused(s, IDENT, [*a, 1], pa) == "block_key_mismatch"
    assert same(lives(restored(s, IDENT, [*b, 1]).caches), lives(conversation(b)))

    # a manifest of one model naming another model's blocks (the same tokens): its chain starts elsewhere
    s2 = store(tmp_path / "two")
    t = toks(40)
    x = (await s2.put(t, conversation(t), IDENT)).path
    y = (await s2.put(t, conversation(t), OTHER)).path
    rewrite(x, lambda w: w["blocks"].__setitem__("keys", keys(y)))
    aside = shutil.copyfile(x, tmp_path / "aside.spilld")
    s2 = rescanned(tmp_path / "two")  # its keys are not the chain of its tokens: refused by the validator
    assert s2.counters.quarantined == 1 and not os.path.exists(x)
    assert isinstance(s2.lookup(IDENT, "", [*t, 1]), Miss)
    with pytest.raises(errors.BlockKeyMismatch):  # loaded by path all the same: refused
        spilld.load(aside, blocks=s2.block_path)
    assert same(lives(restored(s2, OTHER, [*t, 1]).caches), lives(conversation(t)))


def _token_20_changed(w: dict[str, Any]) -> None:
    t = fmt.decode_tokens(w["tokens"])
    w["tokens"] = fmt.encode_tokens([*t[:20], t[20] + 1, *t[21:]])


@pytest.mark.asyncio
async def test_a_manifest_whose_tokens_disagree_with_its_blocks_takes_no_valid_block_with_it(
    tmp_path: Path,
) -> None:
    s = store(tmp_path)
    pa, _, a, b = await _two_sharing(s)
    x = rewrite(pa, _token_20_changed, os.path.join(os.path.dirname(pa), entry_name()))  # keys kept: A's
    os.unlink(pa)
    s = rescanned(tmp_path)
    hit = s.lookup(IDENT, "", [*a, 1])
    if isinstance(hit, Hit) and hit.entry.path == x:
        assert isinstance(s.restore(hit, IDENT), Miss)
    assert not any(q.endswith(BLOCK_EXT) for q in quarantined(str(tmp_path)))
    assert same(lives(restored(s, IDENT, [*b, 1]).caches), lives(conversation(b)))


@pytest.mark.asyncio
async def test_a_manifest_whose_blocks_hold_more_rows_than_its_tokens_is_refused(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, pb, _, b = await _two_sharing(s)
    rewrite(pa, lambda w: w["blocks"]["keys"].append(w["blocks"]["keys"][-1]))  # 4 blocks: 64 rows, 52 tokens
    with pytest.raises(errors.BlockInvalid) as exc:
        read_header(pa)
    assert exc.value.code == "block_invalid"
    s2 = rescanned(tmp_path)
    assert s2.count == 1 and s2.entry_at(pa) is None and s2.stats()["quarantined"] == 1
    assert s2.stats()["blocks_reclaimed"] == 1  # its own block: no manifest names it now
    assert sorted(map(key_of, blocks_on_disk(str(tmp_path)))) == sorted(keys(pb))
    assert same(lives(restored(s2, IDENT, [*b, 1]).caches), lives(conversation(b)))


@pytest.mark.asyncio
async def test_a_block_is_not_readable_alone(tmp_path: Path) -> None:
    s = store(tmp_path)
    pa, pb, a, b = await _two_sharing(s)
    block = block_file(s, keys(pa)[0])
    assert read_header(block).block is not None  # a valid block...
    with pytest.raises(errors.BlockInvalid) as exc:
        spilld.load(block)  # ...read only through a manifest that names it
    assert exc.value.code == "block_invalid"
    renamed = copy_to(block, os.path.dirname(block), entry_name())
    with pytest.raises(errors.BlockInvalid):
        spilld.load(renamed)
    s2 = rescanned(tmp_path)
    assert s2.stats()["quarantined"] == 1 and not os.path.exists(renamed)
    assert {e.path for e in s2.entries} == {pa, pb}
    for conv in (a, b):
        assert same(lives(restored(s2, IDENT, [*conv, 1]).caches), lives(conversation(conv)))


# --- 7. the daemon's path ---------------------------------------------------------------------------


@asynccontextmanager
async def served(identity: spilld.Identity, name: str, **kw: Any) -> AsyncIterator[tuple[Daemon, AsyncClient]]:
    """A daemon cutting blocks of ``B`` and a client of it; both gone after."""
    d = Daemon(new_root(), ["--cap", "256MiB", "--block-tokens", str(B), "--durability", "none"]).start()
    client = None
    try:
        client = await AsyncClient.open(d.socket, identity=identity, name=name, **kw)
        yield d, client
    finally:
        if client is not None:
            await client.close()
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_the_daemon_writes_shared_blocks_once_and_restores_exactly() -> None:
    model = tiny_llama()
    async with served(spilld.model_identity(model, model_id="m"), "blocks") as (d, client):
        prefix = random_tokens(2 * B, seed=1)
        convs = [[*prefix, *random_tokens(20, seed=2)], [*prefix, *random_tokens(20, seed=3)]]  # 3 blocks each
        caches = [prefill(model, make_prompt_cache, prefix, c[2 * B :]) for c in convs]
        for conv, cache in zip(convs, caches, strict=True):
            assert (await client.spill(conv, cache, droppable=False)).stored
        st = (await client.status())["store"]
        assert (st["entries"], st["blocks"], st["blocks_written"], st["blocks_reused"]) == (2, 4, 4, 2)
        assert len(blocks_on_disk(d.dir)) == 4 and st["bytes"] == disk_bytes(d.dir)
        for conv, cache in zip(convs, caches, strict=True):
            got = await client.load([*conv, 5])
            assert got is not None and got.tokens == conv
            want = next_logits(model, cache, 5)
            assert logits_equal(next_logits(model, got.caches, 5), want)
            assert not logits_equal(next_logits(model, prefill(model, make_prompt_cache, conv[:-1]), 5), want)

        # a blocks-only hit: the one conversation with this system prompt cannot be cut (an attachment)
        system, new = random_tokens(2 * B, seed=7), random_tokens(6, seed=8)
        att = Attachment("draft", {"n": 1}, [mx.ones((2, 3))])
        stored = prefill(model, make_prompt_cache, system, random_tokens(12, seed=9))
        assert (await client.spill([*system, *random_tokens(12, seed=9)], stored, attachments=[att])).stored
        hit = await client.lookup([*system, *new])
        assert isinstance(hit, spilld.Hit) and hit.blocks_only and hit.matched == 2 * B
        got = await client.load([*system, *new])
        assert got is not None and got.tokens == system and got.attachments == []
        want = next_logits(model, prefill(model, make_prompt_cache, system), new[0])
        assert logits_equal(next_logits(model, got.caches, new[0]), want)
        assert not logits_equal(next_logits(model, stored, new[0]), want)  # the negative control


@pytest.mark.asyncio
@pytest.mark.parametrize("shm", [False, True])
async def test_a_client_sends_only_the_rows_the_daemon_does_not_hold(shm: bool) -> None:
    kinds = ("kv", "quantized", "hybrid_list", "rotating")  # cut and uncut caches, a list with both
    async with served(IDENT, "held", shm=shm) as (_d, client):
        first, turn = toks(3 * B + 5), toks(5 * B + 3)  # the turn extends the first: 3 blocks held
        assert (await client.spill(first, conversation(first, kinds), droppable=False)).stored
        before = (await client.status())["ingest"]["held_bytes"]
        assert before == 0
        assert (await client.spill(turn, conversation(turn, kinds), droppable=False)).stored
        st = await client.status()
        header, _ = plan(turn, conversation(turn, kinds), identity=IDENT)
        slots = header.slots()
        held = sum(slots[i].nbytes * 3 * B // slots[i].shape[-2] for i in positional_slots(header))
        assert held > 0 and st["ingest"]["held_bytes"] == held  # 3 blocks' rows of every cut tensor, not sent
        assert st["store"]["blocks_reused"] == 3 and st["store"]["blocks_written"] == 5
        for prompt, want in ((first, conversation(first, kinds)), (turn, conversation(turn, kinds))):
            got = await client.load([*prompt, 1])
            assert got is not None and got.tokens == prompt
            assert same(lives(got.caches), lives(want))
        assert not same(lives((await client.load([*first, 1])).caches), lives(conversation(turn, kinds)))  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_a_put_whose_held_blocks_went_fails_and_leaves_nothing(tmp_path: Path) -> None:
    s = store(tmp_path)
    first, turn = toks(2 * B + 3), toks(4 * B)
    await s.put(first, conversation(first), IDENT)
    header, _ = plan(turn, conversation(turn), identity=IDENT)
    assert s.held_rows(header) == 2 * B
    s.remove_where(lambda e: True)  # evicted after the client was told the daemon held them
    await s.delete_doomed_async()
    assert s.held_rows(header) == 0
    with pytest.raises(errors.HeldBlockGone) as got:
        await s.put(turn, conversation(turn), IDENT, held_rows=2 * B)
    assert got.value.code == "held_block_gone"
    assert s.count == 0 and not blocks_on_disk(str(tmp_path)) and not manifests_on_disk(str(tmp_path))


@pytest.mark.asyncio
async def test_held_blocks_that_go_while_the_put_makes_its_folder_fail_it_as_held_block_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put's first wait (making its folder, which may evict to make room) comes before its blocks are pinned:
    a held block evicted there fails the put with `held_block_gone`, not an error about rows it was never sent
    (found in review)."""
    s = store(tmp_path)
    first, turn = toks(2 * B + 3), toks(4 * B)
    await s.put(first, conversation(first), IDENT)
    real = s._make_folder

    async def evicting(folder: str, room: bool = False) -> None:
        s.remove_where(lambda e: True)  # room made for the folder: every entry went, and its blocks
        await s.delete_doomed_async()
        await real(folder, room)

    monkeypatch.setattr(s, "_make_folder", evicting)
    with pytest.raises(errors.HeldBlockGone):
        await s.put(turn, conversation(turn), IDENT, held_rows=2 * B)
    assert s.count == 0 and not blocks_on_disk(str(tmp_path)) and not manifests_on_disk(str(tmp_path))


@pytest.mark.asyncio
async def test_a_reused_block_found_bad_while_the_manifest_is_written_fails_the_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block a put reuses is found bad (by the scrub, or a restore's read) while the put writes its manifest:
    the put fails as `block_missing` and leaves no manifest behind (found in review: the manifest was published
    naming the quarantined block, then indexing it raised KeyError, and the pins of its other blocks leaked)."""
    s = store(tmp_path)
    first = [*toks(2 * B), *toks(4, start=5000)]
    r1 = await s.put(first, conversation(first), IDENT)
    bad = block_file(s, keys(r1.path)[0])
    real = s._write

    async def scrubbed_meanwhile(path: str, *args: Any, **kw: Any) -> Any:
        if not path.endswith(BLOCK_EXT):  # the manifest: the scrub finds the first block bad before it lands
            assert await s.found_bad_async(bad, errors.TensorHashMismatch("flipped", path=bad))
        return await real(path, *args, **kw)

    monkeypatch.setattr(s, "_write", scrubbed_meanwhile)
    turn = [*toks(2 * B), *toks(30, start=7000)]
    with pytest.raises(errors.BlockMissing):
        await s.put(turn, conversation(turn), IDENT)
    monkeypatch.undo()
    assert s.count == 0 and manifests_on_disk(str(tmp_path)) == []  # the first entry named the bad block too
    assert all(rec.pins == 0 and not rec.refs for rec in s.blocks)
    assert blocks_on_disk(str(tmp_path)) == [] and s.total_bytes == disk_bytes(str(tmp_path))
    r = await s.put(turn, conversation(turn), IDENT)  # written anew, whole
    assert same(lives(restored(s, IDENT, [*turn, 1]).caches), lives(conversation(turn))) and r.path


# --- 8. v1 files beside v2 ones ------------------------------------------------------------------


def _place(root: Path, src: str, ident: spilld.Identity) -> str:
    folder = os.path.join(str(root), identity_fingerprint(ident), namespace_hash(ident.namespace))
    return copy_to(src, folder, entry_name())


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_a_v1_file_in_the_root_is_indexed_and_restored(kind: str, tmp_path: Path) -> None:
    path = _place(tmp_path, os.path.join(V1, f"{kind}.spilld"), GOLDEN_IDENT)
    assert read_header(path).version == 1
    s = rescanned(tmp_path)
    assert s.count == 1 and s.entry_at(path) is not None and s.total_bytes == os.path.getsize(path)
    # the golden files record 9 tokens beside caches of 3 to 9 rows: a restore serves only the tokens their caches hold
    h = read_header(path)
    held = min([len(GOLDEN_TOKENS), *(c.offset for c in h.caches if c.offset is not None)])
    prompt = [*GOLDEN_TOKENS, 1]
    if held < len(GOLDEN_TOKENS) and not h.trimmable:
        miss = s.lookup(GOLDEN_IDENT, GOLDEN_IDENT.namespace, prompt)
        assert isinstance(miss, Miss) and miss.reason is MissReason.UNTRIMMABLE
        return
    got = restored(s, GOLDEN_IDENT, prompt)
    assert got.tokens == GOLDEN_TOKENS[:held] and got.header.version == 1
    assert same([live(c) for c in got.caches], [live(c) for c in GOLDEN[kind]()])


@pytest.mark.asyncio
async def test_a_v2_turn_after_a_v1_entry_supersedes_it(tmp_path: Path) -> None:
    old = toks(40)
    spilld.save(tmp_path / "old.spilld", old, conversation(old), identity=IDENT, durability="none")
    v1 = _place(tmp_path / "root", as_v1(str(tmp_path / "old.spilld"), str(tmp_path / "v1.spilld")), IDENT)
    s = rescanned(tmp_path / "root")
    assert same(lives(restored(s, IDENT, [*old, 1]).caches), lives(conversation(old)))
    turn = [*old, *toks(10, start=4000)]
    await s.put(turn, conversation(turn), IDENT)
    assert s.count == 1 and not os.path.exists(v1)  # the v1 entry was a prefix of the new turn
    assert same(lives(restored(s, IDENT, [*old, 1]).caches), lives(conversation(old)))


@pytest.mark.asyncio
async def test_a_v2_stores_blocks_are_read_and_reused_by_v3_manifests(tmp_path: Path) -> None:
    s = store(tmp_path / "root")
    old = toks(40)
    await s.put(old, conversation(old), IDENT)
    for p in blocks_on_disk(str(tmp_path / "root")):  # the blocks as a v2 build wrote them: page-aligned
        as_version(p, p, 2)
        with open(p, "rb") as f:
            assert header_from_bytes(f.read(), os.path.getsize(p)).version == 2 and os.path.getsize(p) > fmt.ALIGN
    s = rescanned(tmp_path / "root")
    assert same(lives(restored(s, IDENT, [*old, 1]).caches), lives(conversation(old)))
    turn = [*old[:32], *toks(20, start=5000)]  # shares both blocks, not the tail
    await s.put(turn, conversation(turn), IDENT)
    assert s.counters.blocks_reused == 2 and s.counters.blocks_written == 1
    assert same(lives(restored(s, IDENT, [*turn, 1]).caches), lives(conversation(turn)))
    assert same(lives(restored(s, IDENT, [*old, 1]).caches), lives(conversation(old)))


@pytest.mark.asyncio
async def test_a_manifest_of_a_newer_format_is_quarantined_and_its_blocks_reclaimed(tmp_path: Path) -> None:
    """What ``docs/format.md`` §9 tells a user who downgrades: a build drops the files of a newer version."""
    s = store(tmp_path / "root")
    t = toks(40)
    await s.put(t, conversation(t), IDENT)
    (m,) = manifests_on_disk(str(tmp_path / "root"))

    def newer(w: dict[str, Any]) -> None:
        w["format"] = fmt.FORMAT_VERSION + 1

    rewrite(m, newer, version=fmt.FORMAT_VERSION + 1)
    with pytest.raises(errors.UnsupportedVersion):
        read_header(m)
    s2 = rescanned(tmp_path / "root")
    assert s2.count == 0 and quarantined(str(tmp_path / "root")) and not os.path.exists(m)
    assert s2.stats()["blocks_reclaimed"] == 2 and blocks_on_disk(str(tmp_path / "root")) == []


@pytest.mark.asyncio
async def test_a_longer_v1_entry_beats_a_shorter_chain_of_blocks(tmp_path: Path) -> None:
    long = toks(60)
    spilld.save(tmp_path / "long.spilld", long, conversation(long), identity=IDENT, durability="none")
    v1 = _place(tmp_path / "root", as_v1(str(tmp_path / "long.spilld"), str(tmp_path / "v1.spilld")), IDENT)
    s = rescanned(tmp_path / "root")
    other = [*long[:20], *toks(20, start=7000)]  # shares one block with the v1 entry
    await s.put(other, conversation(other), IDENT)
    hit = s.lookup(IDENT, "", [*long, 1])
    assert isinstance(hit, Hit) and hit.entry.path == v1 and hit.matched == 60


def test_block_file_names_say_their_key_and_nothing_else_passes() -> None:
    key = bytes(range(32))
    a, b = blocks.block_name(key), blocks.block_name(key)
    assert a != b and blocks.key_of_name(a) == key == blocks.key_of_name(b)
    for name in ("x" * 64 + "-00.spilld-block", key.hex()[:-2] + "-00.spilld-block", key.hex() + "-00.spilld",
                 "-" + key.hex() + ".spilld-block"):  # fmt: skip
        assert blocks.key_of_name(name) is None, name


class HeldManifest(fileio.FileOps):
    """While ``hold`` is set, a manifest's rename waits for ``go``: a put between its blocks and its manifest."""

    def __init__(self) -> None:
        self.hold, self.reached, self.go = False, threading.Event(), threading.Event()

    def rename(self, src: str, dst: str) -> None:
        if self.hold and dst.endswith(".spilld"):
            self.reached.set()
            self.go.wait(10)
        super().rename(src, dst)


@pytest.mark.asyncio
async def test_a_lookup_while_the_next_turns_put_writes_finds_the_previous_turn(tmp_path: Path) -> None:
    """Found in review: the chain ran into the put's new blocks, which no manifest names yet, and only manifests
    naming the chain's last block were compared: the previous turn, which serves the prompt, was a miss."""
    ops = HeldManifest()
    s = store(tmp_path, ops=ops)
    first = toks(40)  # 2 blocks and a tail
    a = await s.put(first, conversation(first), IDENT)
    second = [*first, *toks(30, start=7000)]  # the next turn: 2 more blocks
    ops.hold = True
    put = asyncio.ensure_future(s.put(second, conversation(second), IDENT))
    try:
        assert await asyncio.to_thread(ops.reached.wait, 10)
        hit = await s.lookup_async(IDENT, "", [*second, 1])
        assert isinstance(hit, Hit) and hit.entry.path == a.path and hit.matched == 40
    finally:
        ops.go.set()
    await put
    hit = await s.lookup_async(IDENT, "", [*second, 1])
    assert isinstance(hit, Hit) and hit.matched == 70


@pytest.mark.asyncio
async def test_a_branch_inside_an_untrimmable_turn_is_served_by_the_turn_before_it(tmp_path: Path) -> None:
    """Found in review: with a recurrent state beside the KV cache no turn supersedes the one before it; a prompt
    that branched inside the newer turn's blocks compared only that turn (untrimmable): a miss, though the turn
    before it is an exact prefix of the prompt."""
    s = store(tmp_path)
    kinds = ("arrays", "kv")
    first = toks(40)
    a = await s.put(first, conversation(first, kinds), IDENT)
    second = [*first, *toks(30, start=7000)]
    await s.put(second, conversation(second, kinds), IDENT)
    assert s.count == 2
    branch = [*second[:56], *toks(20, start=9000)]  # diverges inside the newer turn's 4th block
    hit = await s.lookup_async(IDENT, "", branch)
    assert isinstance(hit, Hit) and hit.entry.path == a.path and hit.matched == 40


def test_a_manifest_whose_blocks_would_pass_max_total_bytes_is_refused() -> None:
    """Found in review: a manifest's tail of 0 rows and huge widths passed every check and named blocks of 64 GiB
    each (the remote tier's fill took that as its read bound). What a manifest's blocks hold is bounded as a file's
    tensors are: at ``MAX_TOTAL_BYTES`` taken, one byte over ``total_size_too_large``."""
    size = 16

    def manifest(width: int) -> bytes:
        slot = fmt.Slot(0, 0, (1, 1024, 0, width), "float16", fmt.xxh3(b""))  # no rows: its blocks' sized by it
        entry = fmt.CacheEntry("kv", 1, size, 0, True, {}, [slot, dataclasses.replace(slot)])
        h = fmt.Header(fmt.FORMAT_VERSION, 0, "spilld/mlx-lm/1", fmt.Identity("m"), list(range(size)), [entry])
        h.blocks = fmt.BlockList(size, blocks.chain(blocks.header_root(h, size), h.tokens, size, 1))
        fmt.plan_layout(h)
        return fmt.encode_prefix(fmt.pack_header(h), align=h.align)[0]

    at = fmt.MAX_TOTAL_BYTES // (2 * 1024 * size * 2)  # two tensors, `size` rows of f16 a head: MAX_TOTAL_BYTES
    assert blocks.cache_bytes(header_from_bytes(manifest(at), len(manifest(at)))) == fmt.MAX_TOTAL_BYTES
    with pytest.raises(errors.TotalSizeTooLarge):
        header_from_bytes(data := manifest(at + 1), len(data))
