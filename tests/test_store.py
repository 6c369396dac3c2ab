"""The cold-tier store: layout, scan, lookup rules, supersede, LRU eviction, quarantine, checkpoints."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
import spilld.saver
from spilld import fileio, matching
from spilld import format as fmt
from spilld.entries import Hit, Miss, MissReason, checkpoint_namespace, identity_fingerprint, namespace_hash
from spilld.store import DEFAULT_DISK_CAP, EXT, QUARANTINE, Store, default_disk_cap
from spilld.store.pins import PINS_FILE
from spilld.store.store import LOOKUP_ATTEMPTS
from tests.blocks_corpus import files
from tests.caches import chunked, fill, live, same

IDENT = spilld.Identity("model-a", "cfg-a", "tok-a", "")
OTHER = spilld.Identity("model-a", "cfg-b", "tok-a", "")  # same model id, other config: another fingerprint


def ident(namespace: str = "", base: spilld.Identity = IDENT) -> spilld.Identity:
    return spilld.Identity(base.model_id, base.config_fingerprint, base.tokenizer_hash, namespace)


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def kv_layers(n: int, layers: int = 2, seed: int = 0) -> list[Any]:
    return [fill(C.KVCache(), n, seed=seed + i) for i in range(layers)]


def hybrid(n: int, seed: int = 0) -> list[Any]:
    """A recurrent layer (ArraysCache: no position, never trimmable) beside an attention layer."""
    mx.random.seed(seed)
    state = C.ArraysCache(2)
    state[0] = mx.random.normal((1, 3, 16))
    state[1] = mx.random.normal((1, 2, 8, 8))
    mx.eval(state[0], state[1])
    return [state, fill(C.KVCache(), n, seed=seed + 1)]


def wrapped_rotating(n: int, seed: int = 0) -> list[Any]:
    c = fill(C.RotatingKVCache(max_size=16, keep=4), n, chunk=3, seed=seed)
    assert c.offset > 16  # the ring has wrapped: the front is gone
    return [c]


def spilld_files(root: Path) -> list[str]:
    """Every published entry under the root (quarantine excluded), sorted."""
    return files(str(root), EXT)


def quarantined(root: Path) -> list[str]:
    q = root / QUARANTINE
    return sorted(os.listdir(q)) if q.is_dir() else []


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def lives(caches: list[Any]) -> list[Any]:
    out = [live(c) for c in caches]
    mx.eval(out)
    return out


def trimmed_copy(caches: list[Any], n: int) -> list[Any]:
    """What ``caches`` look like cut back by ``n`` tokens, through the classes' own ``trim``."""
    out = spilld.saver.clone_caches(caches)
    for c in out:
        c.trim(n)
    return out


def restored(store: Store, ident_: spilld.Identity, namespace: str, prompt: list[int]) -> spilld.Loaded:
    hit = store.lookup(ident_, namespace, prompt)
    assert isinstance(hit, Hit), hit
    got = store.restore(hit, ident_)
    assert isinstance(got, spilld.Loaded), got
    return got


# --- 1. round trip through a restart ------------------------------------------------------


@pytest.mark.asyncio
async def test_put_restart_scan_lookup_restore_is_exact(tmp_path: Path) -> None:
    tokens = toks(24)
    caches = [fill(C.KVCache(), 24, seed=1), fill(C.RotatingKVCache(max_size=32, keep=4), 24, chunk=3, seed=2)]
    want = lives(caches)
    r = await Store(tmp_path).put(tokens, caches, IDENT)
    assert r.header.trimmable

    s = Store(tmp_path)
    assert s.scan() == 1
    hit = s.lookup(IDENT, "", [*tokens, 7, 8])
    assert isinstance(hit, Hit)
    assert hit.entry.path == r.path and hit.matched == 24 and not hit.trimmed
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == tokens
    assert [type(c) for c in got.caches] == [C.KVCache, C.RotatingKVCache]
    assert same(lives(got.caches), want)
    assert s.counters.hits == 1


def _in_thread(fn: Any, timeout: float = 20.0) -> Any:
    """``fn()`` on a daemon thread, failing the test if it has not returned within ``timeout`` (a hang)."""
    import threading

    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} still blocked after {timeout} s"
    return out[0]


@pytest.mark.asyncio
async def test_special_files_named_like_entries_are_left_alone_and_block_nothing(tmp_path: Path) -> None:
    """A FIFO or a folder named like a cache file, and a FIFO at the pins file's name: a restart's scan, `spilld ls`
    and the pins reader pass them (a FIFO without a writer used to block the scan for ever: found in review) and
    leave them where they are; the good entry beside them is served."""
    from spilld.store.listing import list_entries
    from spilld.store.pins import PINS_FILE, read_pins

    tokens = toks(24)
    r = await Store(tmp_path).put(tokens, kv_layers(24), IDENT)
    folder = os.path.dirname(r.path)
    fifo, sub = os.path.join(folder, "fifo" + EXT), os.path.join(folder, "folder" + EXT)
    os.mkfifo(fifo, 0o600)
    os.mkdir(sub)
    os.mkfifo(os.path.join(tmp_path, PINS_FILE), 0o600)
    s = Store(tmp_path)
    assert _in_thread(s.scan) == 1
    assert _in_thread(lambda: [row["path"] for row in list_entries(str(tmp_path))]) == [r.path]
    assert _in_thread(lambda: read_pins(str(tmp_path))) == []
    with pytest.raises(spilld.errors.StorageError, match="not a regular file"):
        spilld.loader.read_header(fifo)
    assert os.path.exists(fifo) and os.path.isdir(sub) and quarantined(tmp_path) == []
    assert same(lives(restored(s, IDENT, "", [*tokens, 1]).caches), lives(kv_layers(24)))


@pytest.mark.asyncio
async def test_a_name_that_is_not_a_regular_file_stops_no_block_reuse_or_reclamation(tmp_path: Path) -> None:
    """Found in review: one name in a namespace folder that is not a regular file (a user's folder ``my-notes.spilld``)
    marked the whole folder unsure at every scan, so none of its blocks was spilld's: a put wrote them again beside
    the old copies, the disk grew every turn, an evict of every entry left them all, and a restart reclaimed none.
    Such a name (a folder, a FIFO, a link) is skipped now; only a file unreadable now keeps the folder's blocks."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    r = await s.put(toks(64), kv_layers(64), IDENT)
    folder = os.path.dirname(r.path)
    theirs = ["link" + EXT, "my-notes" + EXT, "pipe" + EXT]
    os.symlink(tmp_path, os.path.join(folder, theirs[0]))
    os.mkdir(os.path.join(folder, theirs[1]))
    os.mkfifo(os.path.join(folder, theirs[2]), 0o600)
    again = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    assert again.scan() == 1
    await again.put(toks(80), kv_layers(80), IDENT)  # the next turn: its first four blocks are the ones on disk
    assert (again.counters.blocks_reused, again.counters.blocks_written) == (4, 1)
    assert len(os.listdir(folder)) == len(theirs) + 1 + 5  # one manifest (the first superseded), five blocks
    await again.evict_async()
    assert sorted(os.listdir(folder)) == theirs
    last = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    assert last.scan() == 0 and sorted(os.listdir(folder)) == theirs


@pytest.mark.asyncio
async def test_restore_cuts_caches_and_tokens_to_the_match(tmp_path: Path) -> None:
    tokens = toks(24)
    caches = [fill(C.KVCache(), 24, seed=1), fill(C.RotatingKVCache(max_size=32, keep=4), 24, chunk=3, seed=2)]
    want = lives(trimmed_copy(caches, 24 - 17))
    await Store(tmp_path).put(tokens, caches, IDENT)

    s = Store(tmp_path)
    s.scan()
    hit = s.lookup(IDENT, "", [*tokens[:17], 5, 5, 5])
    assert isinstance(hit, Hit) and hit.matched == 17 and hit.trimmed
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == tokens[:17]
    assert [c.offset for c in got.caches] == [17, 17]
    assert same(lives(got.caches), want)


# --- 2. layout --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_layout_fingerprint_namespace_hex_name(tmp_path: Path) -> None:
    s = Store(tmp_path)
    base = await s.put(toks(8), kv_layers(8), IDENT)
    named = await s.put(toks(8), kv_layers(8), ident("tenant-1"))
    fp = identity_fingerprint(IDENT)
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert namespace_hash("") == "base"
    assert re.fullmatch(r"[0-9a-f]{16}", namespace_hash("tenant-1"))
    for r, ns_dir in ((base, "base"), (named, namespace_hash("tenant-1"))):
        folder, name = os.path.split(r.path)
        assert folder == os.path.join(str(tmp_path), fp, ns_dir)
        assert re.fullmatch(r"[0-9a-f]{24}\.spilld", name)
    assert spilld_files(tmp_path) == sorted([base.path, named.path])


@pytest.mark.asyncio
@pytest.mark.parametrize("namespace", ["../../etc", "/abs", "a/../../b", "\0x", "..", ".", "a/b", "\\..\\x"])
async def test_hostile_namespace_stays_inside_the_root(tmp_path: Path, namespace: str) -> None:
    root = tmp_path / "root"
    s = Store(root)
    r = await s.put(toks(8), kv_layers(8), ident(namespace))
    real = os.path.realpath(r.path)
    assert os.path.commonpath([str(root), real]) == str(root)
    assert os.path.dirname(real) == os.path.join(str(root), identity_fingerprint(IDENT), namespace_hash(namespace))
    assert os.listdir(tmp_path) == ["root"]  # nothing was created beside the root
    assert spilld_files(root) == [r.path]
    # and the entry is found again in that namespace only
    s2 = Store(root)
    assert s2.scan() == 1
    assert restored(s2, ident(namespace), namespace, toks(9)).tokens == toks(8)
    miss = s2.lookup(IDENT, "", toks(9))
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY


# --- 3. lookup rules ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_lookup_picks_the_longest_usable_prefix(tmp_path: Path) -> None:
    s = Store(tmp_path)
    short = await s.put([*toks(12), 1, 1, 1, 1], kv_layers(16), IDENT)
    long = await s.put([*toks(20), 2, 2, 2, 2], kv_layers(24, seed=5), IDENT)
    assert len(s.entries) == 2  # neither is a prefix of the other

    hit = s.lookup(IDENT, "", toks(40))
    assert isinstance(hit, Hit) and hit.entry.path == long.path and hit.matched == 20 and hit.trimmed
    hit = s.lookup(IDENT, "", [*toks(12), 1, 1, 1, 1, 9])
    assert isinstance(hit, Hit) and hit.entry.path == short.path and hit.matched == 16 and not hit.trimmed
    hit = s.lookup(IDENT, "", [*toks(14), 3])
    assert isinstance(hit, Hit) and hit.entry.path == long.path and hit.matched == 14
    assert s.counters.misses == {r.value: 0 for r in MissReason}


@pytest.mark.asyncio
async def test_lookup_is_capped_at_len_minus_one(tmp_path: Path) -> None:
    s = Store(tmp_path)
    caches = kv_layers(16)
    want = lives(trimmed_copy(caches, 1))
    await s.put(toks(16), caches, IDENT)
    hit = s.lookup(IDENT, "", toks(16))
    assert isinstance(hit, Hit) and hit.matched == 15 and hit.trimmed
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == toks(15)
    assert [c.offset for c in got.caches] == [15, 15]
    assert same(lives(got.caches), want)
    # a one-token prompt can use nothing: that token must be computed
    miss = s.lookup(IDENT, "", toks(1))
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY


@pytest.mark.asyncio
@pytest.mark.parametrize("block_tokens", [0, 16], ids=["whole", "blocks"])
async def test_a_match_never_passes_the_rows_the_caches_hold(tmp_path: Path, block_tokens: int) -> None:
    # 50 tokens recorded, but one cache saw only 37 of them: no more than 37 can be restored
    s = Store(tmp_path, block_tokens=block_tokens)
    caches = [fill(C.KVCache(), 50, seed=1), fill(C.KVCache(), 37, seed=2)]
    await s.put(toks(50), caches, IDENT)
    hit = s.lookup(IDENT, "", [*toks(50), 7, 7])
    assert isinstance(hit, Hit) and hit.matched == 37
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == toks(37) and [c.offset for c in got.caches] == [37, 37]
    assert same(lives(got.caches), lives([trimmed_copy(caches, 13)[0], caches[1]]))
    # nor does it supersede an entry that serves more (found in review: the longer record took its place)
    full = [fill(C.KVCache(), 50, seed=1), fill(C.KVCache(), 50, seed=2)]
    s2 = Store(tmp_path / "s2", block_tokens=block_tokens)
    await s2.put(toks(50), full, IDENT)
    await s2.put([*toks(50), 9, 9], [fill(C.KVCache(), 52, seed=1), fill(C.KVCache(), 37, seed=2)], IDENT)
    hit = s2.lookup(IDENT, "", [*toks(50), 7])
    assert isinstance(hit, Hit) and hit.matched == 50
    # and one that cannot be cut to its rows serves nothing: it replaces nothing either, even holding more rows
    s3 = Store(tmp_path / "s3", block_tokens=block_tokens)
    longer = [*toks(50), 9, 9]
    await s3.put(longer, [fill(C.KVCache(), 52, seed=1), fill(C.KVCache(), 37, seed=2)], IDENT)  # serves 37
    await s3.put(longer, [fill(C.RotatingKVCache(max_size=16, keep=4), 40, chunk=3, seed=3)], IDENT)  # 40, uncut
    hit = s3.lookup(IDENT, "", [*toks(50), 7])
    assert isinstance(hit, Hit) and hit.matched == 37
    # untrimmable, such an entry cannot serve a prompt at all: it holds fewer rows than its tokens
    await s.put(toks(50, start=5000), [fill(C.RotatingKVCache(max_size=16, keep=4), 37, chunk=3, seed=3)], IDENT)
    miss = s.lookup(IDENT, "", [*toks(50, start=5000), 7])
    assert isinstance(miss, Miss) and miss.reason is MissReason.UNTRIMMABLE


@pytest.mark.asyncio
@pytest.mark.parametrize("make", [wrapped_rotating, hybrid], ids=["rotating_wrapped", "arrays_hybrid"])
async def test_untrimmable_entry_needing_a_cut_is_skipped(tmp_path: Path, make: Any) -> None:
    s = Store(tmp_path)
    caches = make(40)
    want = lives(caches)
    r = await s.put(toks(40), caches, IDENT)
    assert r.header.trimmable is False

    for prompt in (toks(40), [*toks(30), 9]):  # equal prompt: matches 39; diverging: matches 30
        miss = s.lookup(IDENT, "", prompt)
        assert isinstance(miss, Miss) and miss.reason is MissReason.UNTRIMMABLE
    assert s.counters.misses[MissReason.UNTRIMMABLE.value] == 2

    # an exact prefix of a longer prompt needs no cut: a hit
    hit = s.lookup(IDENT, "", [*toks(40), 9])
    assert isinstance(hit, Hit) and hit.entry.path == r.path and hit.matched == 40 and not hit.trimmed
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == toks(40)
    assert same(lives(got.caches), want)
    assert s.counters.hits == 1


@pytest.mark.asyncio
async def test_untrimmable_longer_match_falls_back_to_a_shorter_usable_entry(tmp_path: Path) -> None:
    s = Store(tmp_path)
    short = await s.put([*toks(8), 5], kv_layers(9), IDENT)  # trimmable, shares 8
    await s.put(toks(40), wrapped_rotating(40), IDENT)  # shares 30, but needs a cut
    hit = s.lookup(IDENT, "", [*toks(30), 9])
    assert isinstance(hit, Hit) and hit.entry.path == short.path and hit.matched == 8


@pytest.mark.asyncio
async def test_min_reusable_is_honoured(tmp_path: Path) -> None:
    s = Store(tmp_path)
    c = chunked(24)
    assert c.start_position == 15
    want = lives(trimmed_copy([c], 4))
    r = await s.put(toks(24), [c], IDENT)
    assert r.header.trimmable and r.header.min_reusable_offset == 15

    for n in (10, 14, 15):  # below the start position, or short of the chunk boundary after it (16)
        miss = s.lookup(IDENT, "", [*toks(n), 9])
        assert isinstance(miss, Miss) and miss.reason is MissReason.UNTRIMMABLE
    hit = s.lookup(IDENT, "", [*toks(16), 9])
    assert isinstance(hit, Hit) and hit.matched == 16
    hit = s.lookup(IDENT, "", [*toks(20), 9])
    assert isinstance(hit, Hit) and hit.matched == 20
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == toks(20)
    assert got.caches[0].offset == 20 and got.caches[0].start_position == 15
    assert same(lives(got.caches), want)
    assert s.counters.misses[MissReason.UNTRIMMABLE.value] == 3 and s.counters.hits == 1


@pytest.mark.asyncio
async def test_namespaces_are_isolated(tmp_path: Path) -> None:
    s = Store(tmp_path)
    await s.put(toks(16), kv_layers(16), ident("a"))
    for ns in ("", "b", "A", "a "):
        miss = s.lookup(ident(ns), ns, toks(20))
        assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY
    hit = s.lookup(ident("a"), "a", toks(20))
    assert isinstance(hit, Hit) and hit.matched == 16
    assert s.counters.misses[MissReason.NO_ENTRY.value] == 4


@pytest.mark.asyncio
async def test_other_identity_misses_with_identity_mismatch(tmp_path: Path) -> None:
    s = Store(tmp_path)
    await s.put(toks(16), kv_layers(16), IDENT)
    others = [
        OTHER,
        spilld.Identity("model-b", "cfg-a", "tok-a", ""),
        spilld.Identity("model-a", "cfg-a", "tok-b", ""),
    ]
    for other in others:
        assert identity_fingerprint(other) != identity_fingerprint(IDENT)
        miss = s.lookup(other, "", toks(20))
        assert isinstance(miss, Miss) and miss.reason is MissReason.IDENTITY_MISMATCH
    # a prompt sharing nothing is no entry at all, whatever the identity
    miss = s.lookup(OTHER, "", toks(20, start=5))
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY
    assert s.counters.misses[MissReason.IDENTITY_MISMATCH.value] == 3
    assert s.counters.misses[MissReason.NO_ENTRY.value] == 1
    assert s.counters.hits == 0


def test_empty_store_misses_with_no_entry(tmp_path: Path) -> None:
    s = Store(tmp_path)
    assert s.scan() == 0
    miss = s.lookup(IDENT, "", toks(20))
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY
    assert s.counters.misses == {**{r.value: 0 for r in MissReason}, "no_entry": 1}
    assert s.counters.hits == 0


# --- 4. supersede ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_same_tokens_again_replace_the_first_file(tmp_path: Path) -> None:
    s = Store(tmp_path)
    first = await s.put(toks(16), kv_layers(16), IDENT)
    second = await s.put(toks(16), kv_layers(16, seed=9), IDENT)
    assert first.path != second.path
    assert spilld_files(tmp_path) == [second.path]
    assert [e.path for e in s.entries] == [second.path]
    assert s.counters.superseded == 1 and s.counters.stored == 2


@pytest.mark.asyncio
async def test_longer_trimmable_continuation_removes_its_ancestor(tmp_path: Path) -> None:
    s = Store(tmp_path)
    ancestor = await s.put(toks(16), kv_layers(16), IDENT)
    other_ns = await s.put(toks(16), kv_layers(16), ident("x"))
    other_fp = await s.put(toks(16), kv_layers(16), OTHER)
    longer = await s.put(toks(24), kv_layers(24), IDENT)
    assert not os.path.exists(ancestor.path)
    assert spilld_files(tmp_path) == sorted([other_ns.path, other_fp.path, longer.path])
    assert s.counters.superseded == 1
    hit = s.lookup(IDENT, "", [*toks(16), 9])
    assert isinstance(hit, Hit) and hit.entry.path == longer.path and hit.matched == 16


@pytest.mark.asyncio
async def test_longer_untrimmable_entry_keeps_its_ancestor(tmp_path: Path) -> None:
    s = Store(tmp_path)
    ancestor = await s.put(toks(16), hybrid(16), IDENT)
    longer = await s.put(toks(24), hybrid(24, seed=3), IDENT)
    assert spilld_files(tmp_path) == sorted([ancestor.path, longer.path])
    assert s.counters.superseded == 0
    # which is right: only the ancestor can serve a prompt that leaves the longer entry at 20
    hit = s.lookup(IDENT, "", [*toks(20), 9])
    assert isinstance(hit, Hit) and hit.entry.path == ancestor.path and hit.matched == 16


# --- 5. disk cap and LRU ----------------------------------------------------------------------

A, B, Cc = toks(16, start=100), toks(16, start=200), toks(16, start=300)


def entry_size(tmp_path: Path) -> int:
    """The size of one entry of A, B or Cc (same shapes, same token count: same size)."""
    r = spilld.save(str(tmp_path / "probe.spilld"), A, kv_layers(16), identity=IDENT)
    os.unlink(r.path)
    return r.file_bytes


@pytest.mark.asyncio
async def test_disk_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    root = tmp_path / "root"
    s = Store(root, disk_cap=2 * size + size // 2)
    ra = await s.put(A, kv_layers(16), IDENT)
    rb = await s.put(B, kv_layers(16), IDENT)
    assert ra.file_bytes == rb.file_bytes == size and s.total_bytes == 2 * size
    rc = await s.put(Cc, kv_layers(16), IDENT)
    assert spilld_files(root) == sorted([rb.path, rc.path])
    assert s.counters.evicted == 1 and s.total_bytes == 2 * size
    miss = s.lookup(IDENT, "", [*A, 1])
    assert isinstance(miss, Miss) and miss.reason is MissReason.EVICTED
    assert s.counters.misses[MissReason.EVICTED.value] == 1


@pytest.mark.asyncio
async def test_restore_counts_as_use(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    root = tmp_path / "root"
    s = Store(root, disk_cap=2 * size + size // 2)
    ra = await s.put(A, kv_layers(16), IDENT)
    rb = await s.put(B, kv_layers(16), IDENT)
    assert restored(s, IDENT, "", [*A, 1]).tokens == A
    rc = await s.put(Cc, kv_layers(16), IDENT)
    assert not os.path.exists(rb.path)
    assert spilld_files(root) == sorted([ra.path, rc.path])
    miss = s.lookup(IDENT, "", [*B, 1])
    assert isinstance(miss, Miss) and miss.reason is MissReason.EVICTED


@pytest.mark.asyncio
async def test_lru_order_survives_a_restart_through_mtimes(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    root = tmp_path / "root"
    cap = 2 * size + size // 2
    s = Store(root, disk_cap=cap)
    ra = await s.put(A, kv_layers(16), IDENT)
    rb = await s.put(B, kv_layers(16), IDENT)
    before = os.stat(ra.path).st_mtime_ns
    assert restored(s, IDENT, "", [*A, 1]).tokens == A
    assert os.stat(ra.path).st_mtime_ns > before
    assert os.stat(ra.path).st_mtime_ns > os.stat(rb.path).st_mtime_ns

    s2 = Store(root, disk_cap=cap)
    assert s2.scan() == 2
    rc = await s2.put(Cc, kv_layers(16), IDENT)
    assert spilld_files(root) == sorted([ra.path, rc.path])
    assert s2.counters.evicted == 1


@pytest.mark.asyncio
async def test_an_entry_larger_than_the_cap_is_kept_and_evicts_the_rest(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    root = tmp_path / "root"
    s = Store(root, disk_cap=size // 2)
    ra = await s.put(A, kv_layers(16), IDENT)
    assert spilld_files(root) == [ra.path] and s.counters.evicted == 0
    rb = await s.put(B, kv_layers(16), IDENT)
    assert spilld_files(root) == [rb.path] and s.counters.evicted == 1


@pytest.mark.asyncio
async def test_scan_evicts_down_to_a_smaller_cap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    size = entry_size(tmp_path)
    root = tmp_path / "root"
    s = Store(root, disk_cap=10 * size)
    for t in (A, B, Cc):
        await s.put(t, kv_layers(16), IDENT)
    s2 = Store(root, disk_cap=size + size // 2)
    with caplog.at_level("WARNING", logger="spilld.store"):
        assert s2.scan() == 1
    assert [e.tokens.tolist() for e in s2.entries] == [Cc]
    assert s2.counters.evicted == 2
    # said, with what went (found in review: a daemon started with a lower, or mistyped, --disk-cap emptied its store
    # with no line but the entry counts before and after)
    said = [r.getMessage() for r in caplog.records if "to fit the disk cap" in r.getMessage()]
    assert said == [f"{root}: evicted 2 entries ({2 * size} bytes) to fit the disk cap of {size + size // 2} bytes"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="spilld.store"):
        Store(root, disk_cap=size + size // 2).scan()  # nothing to evict: nothing said
    assert not [r for r in caplog.records if "to fit the disk cap" in r.getMessage()]


# --- 6. scan ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_scan_reaps_temp_orphans(tmp_path: Path) -> None:
    r = await Store(tmp_path).put(toks(16), kv_layers(16), IDENT)
    orphans = [fileio.temp_path_for(r.path), fileio.temp_path_for(r.path + ".x")]
    for o in orphans:
        assert fileio.is_temp_name(os.path.basename(o))
        with open(o, "wb") as f:
            f.write(b"half a file")
    s = Store(tmp_path)
    assert s.scan() == 1
    assert s.counters.reaped_temp == 2
    assert sorted(os.listdir(os.path.dirname(r.path))) == [os.path.basename(r.path)]
    assert quarantined(tmp_path) == []


@pytest.mark.asyncio
async def test_scan_quarantines_a_corrupt_header(tmp_path: Path) -> None:
    s = Store(tmp_path)
    bad = await s.put(toks(16), kv_layers(16), IDENT)
    good = await s.put(toks(16, start=5), kv_layers(16), IDENT)
    flip(bad.path, fmt.PREFIX_LEN + 5)
    s2 = Store(tmp_path)
    assert s2.scan() == 1
    assert [e.path for e in s2.entries] == [good.path]
    assert s2.counters.quarantined == 1
    assert not os.path.exists(bad.path)
    q = quarantined(tmp_path)
    assert len(q) == 1 and q[0].endswith("-" + os.path.basename(bad.path))
    assert spilld_files(tmp_path) == [good.path]
    miss = s2.lookup(IDENT, "", [*toks(16), 1])
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["link", "file"])
async def test_a_quarantine_name_that_is_not_a_real_folder_is_never_used(
    tmp_path: Path, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: with ``.quarantine`` a symbolic link to a user's folder, the trim removed the user's oldest
    files (any name); with a user's file there, the bad manifest was deleted instead of kept. Now nothing at that
    name or behind it is touched: the bad file stays where it is, out of the index, and that is said once."""
    from spilld.cli.files import quarantine_files
    from spilld.store.quarantine import QUARANTINE_KEEP

    root, theirs = tmp_path / "root", tmp_path / "theirs"
    theirs.mkdir()
    for i in range(QUARANTINE_KEEP + 8):  # more than the quarantine keeps, some named as spilld names its own
        (theirs / (f"{i:03d}-photo.jpg" if i % 2 else f"{i:03d}-{i}{EXT}")).write_bytes(b"x")
    root.mkdir()
    if what == "link":
        os.symlink(theirs, root / QUARANTINE)
    else:
        (root / QUARANTINE).write_bytes(b"a user's file")
    before = sorted(os.listdir(theirs))
    s = Store(root)
    bad = await s.put(toks(16), kv_layers(16), IDENT)
    good = await s.put(toks(16, start=5), kv_layers(16), IDENT)
    flip(bad.path, fmt.PREFIX_LEN + 5)
    for _ in range(2):  # two starts: the same bad file each time, one log line
        again = Store(root)
        assert again.scan() == 1 and [e.path for e in again.entries] == [good.path]
        assert again.counters.quarantine_removed == 0 and os.path.exists(bad.path)
    assert sorted(os.listdir(theirs)) == before and quarantine_files(str(root)) == []
    assert os.path.islink(root / QUARANTINE) if what == "link" else (root / QUARANTINE).read_bytes() == b"a user's file"
    assert sum("is not a folder spilld may use" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.asyncio
async def test_scan_indexes_every_fingerprint_lookup_matches_the_callers(tmp_path: Path) -> None:
    s = Store(tmp_path)
    ra = await s.put(toks(16), kv_layers(16), IDENT)
    rb = await s.put(toks(24), kv_layers(24), OTHER)
    s2 = Store(tmp_path)
    assert s2.scan() == 2
    assert sorted(e.fingerprint for e in s2.entries) == sorted(
        [identity_fingerprint(IDENT), identity_fingerprint(OTHER)]
    )
    hit = s2.lookup(IDENT, "", toks(30))
    assert isinstance(hit, Hit) and hit.entry.path == ra.path and hit.matched == 16
    hit = s2.lookup(OTHER, "", toks(30))
    assert isinstance(hit, Hit) and hit.entry.path == rb.path and hit.matched == 24
    third = spilld.Identity("model-c", "cfg-c", "tok-c", "")
    miss = s2.lookup(third, "", toks(30))
    assert isinstance(miss, Miss) and miss.reason is MissReason.IDENTITY_MISMATCH


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["other_identity", "other_namespace"])
async def test_scan_quarantines_a_file_in_the_wrong_folder(tmp_path: Path, where: str) -> None:
    s = Store(tmp_path)
    moved = await s.put(toks(16), kv_layers(16), IDENT)
    stays = await s.put(toks(16), kv_layers(16), OTHER if where == "other_identity" else ident("ns"))
    dest = os.path.join(os.path.dirname(stays.path), os.path.basename(moved.path))
    os.rename(moved.path, dest)
    s2 = Store(tmp_path)
    assert s2.scan() == 1
    assert [e.path for e in s2.entries] == [stays.path]
    assert s2.counters.quarantined == 1
    assert not os.path.exists(dest)
    assert len(quarantined(tmp_path)) == 1
    miss = s2.lookup(IDENT, "", [*toks(16), 1])
    assert isinstance(miss, Miss)


# --- 7. restore failures ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_restore_of_a_file_corrupted_after_indexing_is_a_corrupt_miss(tmp_path: Path) -> None:
    s = Store(tmp_path)
    r = await s.put(toks(16), kv_layers(16), IDENT)
    hit = s.lookup(IDENT, "", [*toks(16), 1])
    assert isinstance(hit, Hit)
    slot = next(sl for sl in r.header.slots() if sl.nbytes)
    flip(r.path, r.header.data_start + slot.off + 3)
    got = s.restore(hit, IDENT)
    assert isinstance(got, Miss) and got.reason is MissReason.CORRUPT
    assert s.counters.misses[MissReason.CORRUPT.value] == 1
    assert s.counters.quarantined == 1 and s.counters.hits == 0
    assert not os.path.exists(r.path)
    q = quarantined(tmp_path)
    assert len(q) == 1 and q[0].endswith("-" + os.path.basename(r.path))
    assert s.entries == []
    miss = s.lookup(IDENT, "", [*toks(16), 1])
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY


@pytest.mark.asyncio
async def test_restore_of_a_file_deleted_after_lookup_is_an_evicted_miss(tmp_path: Path) -> None:
    s = Store(tmp_path)
    r = await s.put(toks(16), kv_layers(16), IDENT)
    hit = s.lookup(IDENT, "", [*toks(16), 1])
    assert isinstance(hit, Hit)
    os.unlink(r.path)
    got = s.restore(hit, IDENT)
    assert isinstance(got, Miss) and got.reason is MissReason.EVICTED
    assert s.counters.misses[MissReason.EVICTED.value] == 1
    assert s.counters.quarantined == 0 and s.counters.hits == 0
    assert s.entries == [] and quarantined(tmp_path) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("sync", [False, True], ids=["restore_async", "restore"])
async def test_a_block_that_cannot_be_read_nor_looked_at_is_not_taken_for_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """An unreadable inode (EIO at the open and at the stat of a block) is a miss, and every file stays: only a
    lookup that says ENOENT makes a block gone. Found in review: ``os.path.exists`` read the EIO as absence, and both
    entries naming the block were deleted, a pinned one too, then the block and the rest at the next scan."""
    s = Store(tmp_path, block_tokens=16, disk_cap=2**40)
    a = await s.put(toks(40), kv_layers(40), IDENT, pin=True)  # pinned: the longer one never supersedes it
    b = await s.put(toks(70), kv_layers(70), IDENT)  # names the first two blocks of ``a``
    entry = s.entry_at(b.path)
    assert entry is not None and s.entry_at(a.path) is not None
    bad = s.block_path(entry.blocks[0])
    assert bad is not None

    def eio(real: Any) -> Any:
        def call(path: Any, *args: Any, **kw: Any) -> Any:
            if os.fspath(path) == bad:
                raise OSError(errno.EIO, "Input/output error")
            return real(path, *args, **kw)

        return call

    monkeypatch.setattr(fileio.OWN_OPS, "open_read", eio(fileio.OWN_OPS.open_read))
    monkeypatch.setattr(os, "stat", eio(os.stat))
    monkeypatch.setattr(os, "lstat", eio(os.lstat))
    got = s.restore(Hit(entry, 70), IDENT) if sync else await s.restore_async(Hit(entry, 70), IDENT)
    monkeypatch.undo()
    assert isinstance(got, Miss) and got.reason is MissReason.CORRUPT
    await s.delete_doomed_async()
    assert [e.path for e in s.entries] == [a.path, b.path]  # still served once the disk reads again
    assert os.path.exists(a.path) and os.path.exists(b.path) and os.path.exists(bad)
    s2 = Store(tmp_path, block_tokens=16, disk_cap=2**40)
    s2.scan()
    assert sorted(e.path for e in s2.entries) == sorted([a.path, b.path]) and s2.counters.quarantined == 0
    loaded = s2.restore(Hit(s2.entries[0], s2.entries[0].ntokens), IDENT)
    assert isinstance(loaded, spilld.Loaded)


# --- 8. generation checkpoints ---------------------------------------------------------------


def checkpoint(key: str, prompt: int, generated: int) -> spilld.GenerationCheckpoint:
    return spilld.GenerationCheckpoint(key, "", prompt, generated, 4242, 7, True)


@pytest.mark.asyncio
async def test_checkpoints_find_longest_hidden_from_lookup_removed_by_key(tmp_path: Path) -> None:
    s = Store(tmp_path)
    key = "req-1"
    ns = checkpoint_namespace(key)
    cp_ident = ident(ns)
    r1 = await s.put(toks(20), kv_layers(20), cp_ident, checkpoint=checkpoint(key, 16, 4))
    r2 = await s.put(toks(24), kv_layers(24), cp_ident, checkpoint=checkpoint(key, 16, 8))
    other = await s.put(
        toks(18), kv_layers(18), ident(checkpoint_namespace("req-2")), checkpoint=checkpoint("req-2", 16, 2)
    )
    assert os.path.dirname(r1.path) == os.path.join(str(tmp_path), identity_fingerprint(IDENT), namespace_hash(ns))
    assert os.path.exists(r1.path)  # a checkpoint is never superseded by a longer one

    s2 = Store(tmp_path)
    assert s2.scan() == 3
    e = s2.find_checkpoint(IDENT, key)
    assert e is not None and e.path == r2.path and e.ntokens == 24
    assert e.checkpoint == checkpoint(key, 16, 8)
    assert s2.find_checkpoint(OTHER, key) is None
    assert s2.find_checkpoint(IDENT, "req-3") is None

    got = s2.restore(Hit(e, e.ntokens), cp_ident)
    assert isinstance(got, spilld.Loaded)
    assert got.tokens == toks(24) and got.checkpoint == checkpoint(key, 16, 8)

    miss = s2.lookup(IDENT, "", toks(30))
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY

    assert s2.remove_checkpoints(key) == 2
    assert not os.path.exists(r1.path) and not os.path.exists(r2.path)
    assert s2.find_checkpoint(IDENT, key) is None
    assert spilld_files(tmp_path) == [other.path]
    assert [e.path for e in s2.entries] == [other.path]


# --- 9. default disk cap ------------------------------------------------------------------------


def test_default_disk_cap_is_min_of_64_gib_and_a_quarter_of_free(tmp_path: Path) -> None:
    assert DEFAULT_DISK_CAP == 64 * 1024**3
    root = tmp_path / "root"
    before = shutil.disk_usage(tmp_path).free
    cap = default_disk_cap(str(root))
    after = shutil.disk_usage(tmp_path).free
    assert root.is_dir()
    expect = {min(64 * 1024**3, before // 4), min(64 * 1024**3, after // 4)}
    # free space may move between the calls; both ends bracket the answer
    assert min(expect) <= cap <= max(expect)
    s = Store(root)
    assert min(expect) - 2**20 <= s.disk_cap <= max(expect) + 2**20
    assert Store(root, disk_cap=123).disk_cap == 123


def test_the_default_disk_cap_counts_the_stores_own_bytes_as_its_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the default cap was a quarter of the free space at start, the store's own bytes not counted
    in, so a full store's cap shrank at each restart and its scan evicted a fifth of it. Its cap is now a quarter of
    free space plus its own bytes: the same after a restart, and nothing is evicted."""
    import collections

    root = tmp_path / "root"
    s = Store(root, durability="none")
    for i in range(4):
        asyncio.run(s.put([i * 100 + t for t in range(64)], [fill(C.KVCache(), 64)], IDENT))
    own = s.total_bytes
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * own, 0, 3 * own))  # full: own == (free + own) / 4
    again = Store(root, durability="none")
    again.scan()
    assert again.disk_cap == own and again.count == 4 and again.counters.evicted == 0
    assert again.pin_cap == own // 4  # a quarter of the cap computed again (found in review: of the first one)


# --- 10. durability -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_durability_none_still_writes_loadable_files(tmp_path: Path) -> None:
    s = Store(tmp_path, durability="none")
    assert s.durability is fileio.Durability.NONE
    caches = kv_layers(16)
    want = lives(caches)
    r = await s.put(toks(16), caches, IDENT)
    assert spilld.loader.verify_file(r.path).tokens == toks(16)
    s2 = Store(tmp_path)
    assert s2.scan() == 1
    got = restored(s2, IDENT, "", [*toks(16), 1])
    assert got.tokens == toks(16) and same(lives(got.caches), want)


# --- bugs -----------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_fingerprint_separates_identities_whose_fields_contain_nul(tmp_path: Path) -> None:
    a = spilld.Identity("m\0x", "cfg", "tok", "")
    b = spilld.Identity("m", "x\0cfg", "tok", "")
    s = Store(tmp_path)
    r = await s.put(toks(16), kv_layers(16), a)
    got = s.lookup(b, "", [*toks(16), 1])
    if isinstance(got, Hit):
        s.restore(got, b)  # IdentityMismatch inside: a's valid file is quarantined as "corrupt"
    assert os.path.exists(r.path), "a valid entry of model a was quarantined by a lookup of model b"
    assert isinstance(got, Miss) and got.reason is MissReason.IDENTITY_MISMATCH


@pytest.mark.asyncio
async def test_a_foreign_codec_provider_is_a_miss_and_never_quarantined(tmp_path: Path) -> None:
    from spilld.codecs import default_provider

    ident = spilld.Identity("m", "cfg", "tok", "")
    await Store(tmp_path).put(list(range(8)), [fill(C.KVCache(), 8)], ident)
    other = Store(tmp_path, provider=default_provider().extended("engine-x/1", []))
    other.scan()
    miss = other.lookup(ident, "", list(range(9)))
    assert isinstance(miss, Miss) and miss.reason is MissReason.CODEC_MISMATCH  # told apart from another model
    assert other.counters.quarantined == 0 and len(other.entries) == 1


def test_reserved_checkpoint_namespaces_are_refused(tmp_path: Path) -> None:
    from spilld.entries import check_namespace, checkpoint_namespace

    with pytest.raises(ValueError):
        check_namespace(checkpoint_namespace("k"))
    assert check_namespace("ok") == "ok"


class _FullOnce(fileio.FileOps):
    """ENOSPC on the first data write of the next save (once, or every time)."""

    def __init__(self, persistent: bool = False) -> None:
        self.persistent, self.fired = persistent, 0

    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        if offset > 0 and (self.persistent or not self.fired):
            self.fired += 1
            raise OSError(28, "No space left on device")
        return super().pwritev(fd, bufs, offset)


@pytest.mark.asyncio
async def test_disk_full_evicts_then_retries(tmp_path: Path) -> None:
    from spilld.entries import MissReason

    s = Store(tmp_path, disk_cap=2**40)
    ident = spilld.Identity("m", "cfg", "tok", "")
    await s.put(list(range(8)), [fill(C.KVCache(), 8)], ident)  # the old entry that makes room
    s.ops = _FullOnce()
    r = await s.put(list(range(100, 116)), [fill(C.KVCache(), 16)], ident)
    assert os.path.exists(r.path) and s.counters.evicted == 1 and len(s.entries) == 1
    assert isinstance(s.lookup(ident, "", list(range(9))), spilld.Miss)
    assert s.lookup(ident, "", list(range(9))).reason is MissReason.EVICTED  # type: ignore[union-attr]
    # persistently full: the item fails with its reason, nothing partial is left, counters move
    with pytest.raises(spilld.errors.DiskFull):
        s.ops = _FullOnce(persistent=True)
        await s.put(list(range(200, 216)), [fill(C.KVCache(), 16)], ident)
    assert s.counters.store_errors == 1
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(fileio.TEMP_SUFFIX)]
    assert leftovers == []


@pytest.mark.asyncio
async def test_disk_full_in_a_put_of_blocks_makes_room_for_the_whole_put_at_once(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    for i in range(20):  # whole files of 8 rows (less than a block), all of one size
        await s.put(toks(8, start=10_000 * (i + 1)), kv_layers(8), IDENT)
    one = {e.nbytes for e in s.entries}
    assert len(one) == 1
    new = kv_layers(64)  # 4 blocks, none on disk
    need = spilld.saver.plan([], new)[0].data_bytes
    s.ops = _FullOnce()  # ENOSPC at the first block's first write
    await s.put(toks(64), new, IDENT)
    # LRU entries until what the put still writes is freed: four blocks' worth, not one block's
    assert s.counters.evicted == -(-need // one.pop()) > 4
    assert s.counters.blocks_written == 4 and s.counters.store_errors == 0


# --- folders under concurrent sweeps, failed writes, the lookup index ----------------------------


class _FolderSyncs(fileio.FileOps):
    """Records the folders fsynced; the first one ``fail_in`` names fails (with ``err``), once."""

    def __init__(self, fail_in: str | None = None, err: int = 5) -> None:
        self.fail_in, self.err = fail_in, err
        self.synced: list[str] = []
        self._dirs: dict[int, str] = {}

    def open_dir(self, path: str) -> int:
        fd = super().open_dir(path)
        self._dirs[fd] = path
        return fd

    def fsync(self, fd: int, durability: fileio.Durability) -> None:
        d = self._dirs.get(fd)
        if d is not None and self.fail_in is not None and os.path.basename(d) == self.fail_in:
            self.fail_in = None
            raise OSError(self.err, os.strerror(self.err))
        if d is not None:
            self.synced.append(d)
        super().fsync(fd, durability)

    def close(self, fd: int) -> None:
        self._dirs.pop(fd, None)
        super().close(fd)


@pytest.mark.asyncio
async def test_a_folder_made_by_a_failed_put_is_made_durable_by_the_next(tmp_path: Path) -> None:
    """Found in review: the model folder a put made, whose fsync then failed, was never synced into the root again
    (only folders made in the same call were), so the next put said stored while a power loss could take the
    folder and everything in it."""
    s = Store(tmp_path, disk_cap=2**40)
    fp = identity_fingerprint(IDENT)
    s.ops = ops = _FolderSyncs(fail_in=fp)
    with pytest.raises(spilld.errors.StorageError):
        await s.put(toks(8), kv_layers(8), IDENT)
    assert os.path.isdir(tmp_path / fp)  # made, but its name not durable
    r = await s.put(toks(8), kv_layers(8), IDENT)
    assert str(tmp_path) in ops.synced and str(tmp_path / fp) in ops.synced  # both levels, before "stored"
    assert os.path.exists(r.path)
    ops.synced.clear()
    await s.put(toks(9, start=50), kv_layers(9), IDENT)
    assert ops.synced == [os.path.dirname(r.path)]  # once made durable, a put syncs only its own names


@pytest.mark.asyncio
async def test_a_failed_fsync_of_a_new_folder_is_not_retried_after_making_room(tmp_path: Path) -> None:
    """ENOSPC from the fsync of a folder a put made: found in review, an unrelated entry was evicted and the fsync
    tried again, and the put said stored."""
    s = Store(tmp_path, disk_cap=2**40)
    await s.put(toks(8, start=900), kv_layers(8), OTHER)  # an entry eviction could take
    s.ops = _FolderSyncs(fail_in=identity_fingerprint(IDENT), err=28)
    with pytest.raises(spilld.errors.DiskFull):
        await s.put(toks(8), kv_layers(8), IDENT)
    assert s.counters.evicted == 0 and s.count == 1 and s.counters.store_errors == 1


@pytest.mark.asyncio
async def test_a_failed_fsync_of_the_blocks_folder_fails_the_put_even_when_room_could_be_made(tmp_path: Path) -> None:
    """Found in review: ENOSPC from the folder fsync that makes a put's block names durable was taken for a full
    disk: entries were evicted, the folder fsynced again, and the put said stored. A failed fsync is never
    retried."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    await s.put(toks(40, start=5000), kv_layers(40), IDENT)  # an entry eviction could take
    r0 = s.entries[0].path
    s.ops = _FolderSyncs(fail_in="base", err=28)
    with pytest.raises(spilld.errors.DiskFull):
        await s.put(toks(40), kv_layers(40), IDENT)
    assert [e.path for e in s.entries] == [r0] and s.counters.store_errors == 1
    assert len(spilld_files(tmp_path)) == 1  # no manifest of the failed put
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(fileio.TEMP_SUFFIX)]


class _SweepBeforeCreate(fileio.FileOps):
    """An evict's empty-folder sweep landing between the entry folder's creation and the first write."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def open_new(self, path: str, flags: int = 0) -> int:
        self.store.remove_empty_folders()
        return super().open_new(path, flags)


@pytest.mark.asyncio
async def test_an_evict_sweep_before_the_first_write_does_not_fail_the_save(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40)
    s.ops = _SweepBeforeCreate(s)
    r = await s.put(toks(8), kv_layers(8), IDENT)  # a new model: both its folders are empty until this write
    assert os.path.exists(r.path) and s.counters.store_errors == 0
    assert isinstance(s.lookup(IDENT, "", [*toks(8), 1]), Hit)
    s.ops = fileio.DEFAULT_OPS
    await s.evict_async()
    assert [d for d in os.listdir(tmp_path) if not d.startswith(".")] == []  # the sweep runs again once it may


@pytest.mark.asyncio
async def test_a_write_that_cannot_make_its_folder_is_a_counted_store_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from spilld import errors
    from spilld.entries import identity_fingerprint
    from spilld.store.store import STORE_ERROR_RUN_LOG

    s = Store(tmp_path, disk_cap=2**40)
    (tmp_path / identity_fingerprint(IDENT)).write_bytes(b"a file where the model's folder goes")
    with caplog.at_level("WARNING", logger="spilld.store"):
        for _ in range(STORE_ERROR_RUN_LOG):
            with pytest.raises(errors.StorageError):
                await s.put(toks(4), kv_layers(4), IDENT)
    assert s.counters.store_errors == STORE_ERROR_RUN_LOG and s.counters.errors == {"io_error": STORE_ERROR_RUN_LOG}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # the run's first failure, then one summary at the limit
    assert f"{STORE_ERROR_RUN_LOG} writes" in lines[1]
    (tmp_path / identity_fingerprint(IDENT)).unlink()
    with caplog.at_level("WARNING", logger="spilld.store"):
        await s.put(toks(4), kv_layers(4), IDENT)
    assert "succeed again" in caplog.records[-1].getMessage()


@pytest.mark.asyncio
async def test_lookup_compares_only_entries_that_start_like_the_prompt(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40)
    for i in range(40):
        await s.put(toks(4, start=10 * i), kv_layers(4), IDENT)
        await s.put(toks(4, start=10 * i), kv_layers(4), ident("other"))
    q = s._query(IDENT, "", [*toks(4, start=70), 1], None)
    assert [e.tokens.tolist() for e in q.by_start.values()] == [toks(4, start=70)]
    hit = await s.lookup_async(IDENT, "", [*toks(4, start=70), 1])
    assert isinstance(hit, Hit) and hit.matched == 4
    miss = await s.lookup_async(IDENT, "", [5, 6, 7])
    assert isinstance(miss, Miss) and miss.reason is MissReason.NO_ENTRY


def spilled_again_while_compared(monkeypatch: pytest.MonkeyPatch, s: Store, prompt: list[int], times: int) -> list[str]:
    """Make the next ``times`` comparisons of a lookup each wait, on their worker thread, for the same prompt to be
    spilled again on the loop (superseding the entry they are comparing); the new entries' paths."""
    loop = asyncio.get_running_loop()
    compare = matching.Query.match
    paths: list[str] = []

    def match(q: matching.Query) -> matching.Found:
        found = compare(q)
        if len(paths) < times:
            put = asyncio.run_coroutine_threadsafe(s.put(prompt, kv_layers(len(prompt), seed=len(paths)), IDENT), loop)
            paths.append(put.result(timeout=60).path)
        return found

    monkeypatch.setattr(matching.Query, "match", match)
    return paths


@pytest.mark.asyncio
@pytest.mark.parametrize("block_tokens", [0, 16])
async def test_a_lookup_whose_entry_is_superseded_while_it_compares_finds_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_tokens: int
) -> None:
    s = Store(tmp_path, block_tokens=block_tokens)
    first = await s.put(toks(32), kv_layers(32), IDENT)
    again = spilled_again_while_compared(monkeypatch, s, toks(32), times=1)
    hit = await s.lookup_async(IDENT, "", [*toks(32), 1])
    assert again and again[0] != first.path and [e.path for e in s.entries] == again
    assert isinstance(hit, Hit) and hit.entry.path == again[0] and hit.matched == 32


@pytest.mark.asyncio
async def test_a_lookup_compares_at_most_lookup_attempts_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Store(tmp_path, block_tokens=0)
    await s.put(toks(32), kv_layers(32), IDENT)
    again = spilled_again_while_compared(monkeypatch, s, toks(32), times=LOOKUP_ATTEMPTS)
    miss = await s.lookup_async(IDENT, "", [*toks(32), 1])
    assert len(again) == LOOKUP_ATTEMPTS  # one comparison each, none after the last
    assert isinstance(miss, Miss) and miss.reason is MissReason.EVICTED
    hit = await s.lookup_async(IDENT, "", [*toks(32), 1])
    assert isinstance(hit, Hit) and hit.entry.path == again[-1]


class Keeper:
    """A store listener that keeps each evicted entry's files (as the remote tier's ``evicted`` push does)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.kept: list[str] = []

    def stored(self, entry: Any, written: Any, root: bytes) -> None:
        pass

    def reclaimed(self, block: Any) -> None:
        pass

    def evicted(self, entry: Any, named: list[Any]) -> None:
        for p in [entry.path, *(b.path for b in named)]:
            self.store.keep_file(p)
            self.kept.append(p)


@pytest.mark.asyncio
async def test_an_evicted_entrys_files_wait_for_their_listener_before_their_unlink(tmp_path: Path) -> None:
    """A listener told of an eviction keeps the entry's files (its manifest and its blocks) on disk until it
    releases them; then they go. An eviction for room after ENOSPC tells no listener: its files go at once."""
    s = Store(tmp_path / "root", block_tokens=16)
    keeper = Keeper(s)
    s.listeners.append(keeper)
    await s.put(toks(40), kv_layers(40), IDENT)
    s.disk_cap = s.total_bytes + s.total_bytes // 2
    await s.put(toks(40, start=5000), kv_layers(40, seed=3), IDENT)  # evicts the first
    assert s.counters.evicted == 1 and len(keeper.kept) == 3  # its manifest and its 2 blocks
    assert all(os.path.exists(p) for p in keeper.kept)  # unlinked? not yet: the listener still reads them
    for p in keeper.kept:
        s.release_file(p)
    await s.delete_doomed_async()
    assert not any(os.path.exists(p) for p in keeper.kept)
    keeper.kept.clear()
    assert s.make_room(1)  # ENOSPC: the room must be made now
    await s.delete_doomed_async()
    assert keeper.kept == [] and s.count == 0


@pytest.mark.asyncio
async def test_a_block_put_takes_each_array_once_in_the_lease_then_writes_its_blocks_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's lease is asked once per array (its zero-copy bytes taken), not once per tensor of every block: a
    128 MiB put at B = 64 made 1,024 lease calls and thread hops, and beside a busy engine thread it ran 7-16x
    slower than one file (docs/benchmarks.md). The bytes written are still exactly the arrays'."""
    calls: list[Any] = []

    async def lease(fn: Any) -> Any:
        calls.append(fn)
        return fn()

    batches: list[int] = []
    real_save = spilld.store.store.save_async

    async def save(*a: Any, **kw: Any) -> Any:
        batches.append(kw.get("batch_bytes", 0))
        return await real_save(*a, **kw)

    monkeypatch.setattr(spilld.store.store, "save_async", save)
    caches = [fill(C.KVCache(), 16 * 5 + 3, heads=2, dim=8, seed=s) for s in range(3)]
    store = Store(str(tmp_path), disk_cap=2**30, block_tokens=16)
    await store.put(toks(83), caches, IDENT, run_step=lease)
    assert len(calls) == 2 * len(caches)  # K and V of each cache; it was one a tensor of each of 5 blocks and the tail
    assert batches == [spilld.saver.WRITE_BATCH_BYTES] * 6  # 5 blocks and the manifest, each written in batches
    assert store.counters.blocks_written == 5
    hit = store.lookup(IDENT, "", [*toks(83), 0])
    assert isinstance(hit, Hit) and hit.matched == 83
    got = await store.restore_async(hit, IDENT)
    assert isinstance(got, spilld.loader.Loaded)
    assert all(same(live(a), live(b)) for a, b in zip(got.caches, caches, strict=True))


class SlowFirstPinsWrite(fileio.FileOps):
    """The first rename of the pins file lands late (a busy disk): it waits (1 s at most) for a later one to land."""

    def __init__(self) -> None:
        self.renames = 0
        self.later_landed = threading.Event()

    def rename(self, src: str, dst: str) -> None:
        if os.path.basename(dst) == PINS_FILE:
            self.renames += 1
            if self.renames == 1:
                self.later_landed.wait(1.0)
            else:
                super().rename(src, dst)
                self.later_landed.set()
                return
        super().rename(src, dst)


@pytest.mark.asyncio
async def test_two_pins_at_once_are_both_kept_across_a_restart(tmp_path: Path) -> None:
    """Found in review: each pin wrote the set as it was at its call, on a worker thread, unordered: the older set
    renamed last, and a pin its caller was told was made was gone after a restart."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    a = await s.put(list(range(40)), [fill(C.KVCache(), 40)], IDENT)
    b = await s.put(list(range(900, 940)), [fill(C.KVCache(), 40, seed=2)], IDENT)
    s.ops = SlowFirstPinsWrite()
    assert await asyncio.gather(s.pin_async(a.path), s.pin_async(b.path)) == [True, True]
    again = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    again.scan()
    assert again.stats()["pinned"] == 2


@pytest.mark.asyncio
async def test_a_scan_that_took_the_folders_lock_holds_it_through_its_evictions(tmp_path: Path) -> None:
    """Found in review: a scan that took the lock for itself released it before evicting to the cap, so its unlinks
    ran while another spilld could own the folder."""
    from spilld.lockfile import FileLock
    from spilld.store.store import LOCK_NAME

    writer = Store(tmp_path, disk_cap=2**40)
    for i in range(3):
        await writer.put(toks(8, start=100 * i), kv_layers(8, seed=i), IDENT)
    unlocked: list[str] = []

    class Checked(fileio.FileOps):
        def unlink(self, path: str) -> None:
            probe = FileLock(os.path.join(str(tmp_path), LOCK_NAME), "probe")
            if probe.try_acquire():  # nobody held it: another spilld could have
                probe.release()
                unlocked.append(path)
            super().unlink(path)

    s = Store(tmp_path, disk_cap=writer.entries[0].nbytes, ops=Checked())
    assert not s.lock.held
    assert s.scan() == 1 and s.stats()["evicted"] == 2
    assert unlocked == [] and not s.lock.held


@pytest.mark.asyncio
async def test_a_guests_evictions_leave_the_owners_files_on_disk(tmp_path: Path) -> None:
    """Found in review: a store that scanned a folder another spilld owns (a Spiller writing as a daemon's guest)
    reaped nothing at its scan, but its puts then evicted to its own cap over every entry it indexed, and unlinked
    the owner's manifests, which the owner still served. The owner's entries now leave the guest's index only."""
    owner = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    owner.acquire()
    try:
        theirs = await owner.put(toks(40), kv_layers(40, seed=1), IDENT)
        guest = Store(tmp_path, disk_cap=owner.total_bytes + 100, block_tokens=16)
        assert guest.scan() == 1
        mine = await guest.put(toks(40, start=5000), kv_layers(40, seed=2), IDENT)
        assert guest.entry_at(theirs.path) is None and guest.entry_at(mine.path) is not None  # evicted here
        assert os.path.exists(theirs.path)  # and left on disk: the owner's
        entry = owner.entry_at(theirs.path)
        assert entry is not None and all(os.path.exists(rec.path) for rec in owner.named_blocks(entry))
        assert restored(owner, IDENT, "", toks(41)).tokens == toks(40)
    finally:
        owner.close()


@pytest.mark.asyncio
async def test_an_entry_evicted_while_its_restore_reads_is_an_evicted_miss_and_nothing_is_quarantined(
    tmp_path: Path,
) -> None:
    """Found in review: the read then found the entry's blocks gone from the index (a ``BlockMissing`` naming the
    manifest) and the store quarantined the evicted entry's healthy manifest as corrupt."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    await s.put(toks(40), kv_layers(40), IDENT)
    hit = s.lookup(IDENT, "", toks(41))
    assert isinstance(hit, Hit)
    reached, go = threading.Event(), threading.Event()
    real = s.block_path

    def block_path(key: bytes) -> str | None:  # the read resolves its blocks on a worker thread
        if not go.is_set():
            reached.set()
            go.wait(10)
        return real(key)

    s.block_path = block_path  # type: ignore[method-assign]
    task = asyncio.ensure_future(s.restore_async(hit, IDENT))
    assert await asyncio.to_thread(reached.wait, 10)
    assert s.remove_where(lambda e: True) == 1  # an eviction on the loop meanwhile
    go.set()
    got = await task
    assert isinstance(got, Miss) and got.reason is MissReason.EVICTED
    assert s.stats()["quarantined"] == 0 and not os.path.exists(os.path.join(str(tmp_path), QUARANTINE))


class Reclaims:
    """A store listener that records the blocks it is told were reclaimed: (namespace, key)."""

    def __init__(self) -> None:
        self.told: list[tuple[str, bytes]] = []

    def stored(self, entry: Any, written: Any, root: bytes) -> None:
        pass

    def evicted(self, entry: Any, named: list[Any]) -> None:
        pass

    def reclaimed(self, block: Any) -> None:
        self.told.append((block.namespace, block.key))


@pytest.mark.asyncio
async def test_listeners_hear_of_reclaimed_blocks_a_manifest_named_under_its_namespace_only(tmp_path: Path) -> None:
    """Found in review: the blocks a failed put wrote, which no manifest ever named (nor any event announced),
    were reported reclaimed under namespace '' (the remote tier published tenant keys on the base stream)."""
    acme = ident("acme")

    class FailedManifest(fileio.FileOps):
        def rename(self, src: str, dst: str) -> None:
            if dst.endswith(EXT):
                raise OSError(5, "injected")
            super().rename(src, dst)

    s = Store(tmp_path, block_tokens=16, ops=FailedManifest())
    told = Reclaims()
    s.listeners.append(told)
    with pytest.raises(spilld.errors.StorageError):
        await s.put(toks(40), kv_layers(40), acme)
    assert s.stats()["blocks_reclaimed"] == 2 and told.told == []  # gone, never announced: nothing to say
    s.ops = fileio.FileOps()
    await s.put(toks(40), kv_layers(40), acme)
    keys = list(s.entries[0].blocks)
    assert s.remove_where(lambda e: True) == 1
    assert sorted(told.told) == sorted(("acme", k) for k in keys)


@pytest.mark.asyncio
async def test_an_entry_that_left_while_an_evict_ran_is_not_evicted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: an evict request took its list of entries once, then evicted them in batches; one removed
    between two batches (superseded, evicted for room) was evicted again: counted twice, its listeners told twice."""
    from spilld.store import store as store_module

    monkeypatch.setattr(store_module, "EVICT_BATCH", 1)
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    for i in range(3):
        await s.put(toks(40, start=1000 * (i + 1)), kv_layers(40, seed=i), IDENT)
    last, before = s.entries[-1], s.total_bytes
    third = last.nbytes + sum(r.nbytes for r in s.named_blocks(last))  # no block is shared: each its own
    last = last.path
    evict = asyncio.ensure_future(s.evict_async())
    await asyncio.sleep(0)  # its first batch is out
    assert s.remove_where(lambda e: e.path == last) == 1  # another way out, between two batches
    n, freed = await evict
    assert n == 2 and s.stats()["evicted"] == 2 and s.count == 0
    assert freed == before - third  # the two it evicted, with their blocks: not the third's (review)


@pytest.mark.asyncio
async def test_a_fill_counts_the_bytes_it_writes_and_the_cache_it_adds(tmp_path: Path) -> None:
    """Found in review: files a fill from the shared tier wrote were left out of ``bytes_written`` (and so of the
    day's write budget), which counts every file published; the cache they add counts as new bytes too."""
    src = Store(tmp_path / "a", disk_cap=2**40, block_tokens=16)
    put = await src.put(toks(40), kv_layers(40), IDENT)
    manifest = Path(put.path).read_bytes()
    held = {rec.key: Path(rec.path).read_bytes() for rec in src.blocks}

    async def fetched() -> Any:
        yield held

    s = Store(tmp_path / "b", disk_cap=2**40, block_tokens=16)
    await s.adopt(IDENT, "", manifest, fetched())
    st, want = s.stats(), src.stats()
    assert st["bytes_written"] == len(manifest) + sum(map(len, held.values())) == want["bytes_written"]
    assert st["written_day"] == st["bytes_written"] and st["unique_added"] == want["unique_added"] > 0
    # a second conversation under the same first two blocks: only its own tokens are new (found in review: a
    # fill counted every token as new, and the filled store's write amplification read below 1)
    other = [*toks(32), *toks(8, start=7000)]
    second = await src.put(other, kv_layers(40, seed=9), IDENT)
    added = src.stats()["unique_added"] - want["unique_added"]
    held2 = {rec.key: Path(rec.path).read_bytes() for rec in src.blocks if rec.key not in held}

    async def fetched2() -> Any:
        yield held2

    await s.adopt(IDENT, "", Path(second.path).read_bytes(), fetched2())
    assert s.stats()["unique_added"] - st["unique_added"] == added


@pytest.mark.asyncio
@pytest.mark.parametrize("block_tokens", [0, 16])
async def test_a_supersede_never_removes_what_the_new_entry_cannot_serve(tmp_path: Path, block_tokens: int) -> None:
    """Found in review: a longer entry without attachments superseded an ancestor that had them (a draft model's
    KV, lost), and an untrimmable exact copy superseded a trimmable one (shorter prefixes stopped hitting)."""
    from spilld.saver import Attachment

    def draft(n: int) -> list[Attachment]:
        a = mx.random.normal((1, 2, n, 8))
        mx.eval(a)
        return [Attachment("draft-kv", {"tokens": str(n)}, [a])]

    s = Store(tmp_path / "a", disk_cap=2**40, block_tokens=block_tokens)
    base = toks(40)
    ancestor = await s.put(base, kv_layers(40), IDENT, attachments=draft(40))
    await s.put([*base, 7, 8, 9], kv_layers(43), IDENT)  # longer, no attachments
    assert s.entry_at(ancestor.path) is not None  # kept, with its attachments
    got = restored(s, IDENT, "", [*base, 1])  # and preferred, as many tokens matched: it restores more with them
    assert got.tokens == base and got.attachments and got.attachments[0].schema == "draft-kv"
    s = Store(tmp_path / "b", disk_cap=2**40, block_tokens=block_tokens)
    first = await s.put(base, kv_layers(40), IDENT)  # trimmable
    await s.put(base, kv_layers(40), IDENT, attachments=draft(40))  # the same tokens, not trimmable
    assert s.entry_at(first.path) is not None
    hit = s.lookup(IDENT, "", [*base[:20], 1])
    assert isinstance(hit, Hit) and hit.matched == 20


def two_kv(n: int, seed: int = 0) -> list[Any]:
    return [fill(C.KVCache(), n, seed=seed + i) for i in range(2)]


@pytest.mark.asyncio
async def test_a_lookup_on_a_worker_survives_a_put_to_the_group_it_reads(tmp_path: Path) -> None:
    """Found in review: the match ran on a worker over the loop's own dict of entries sharing a first token; a put
    to that group while the worker walked it raised "dictionary changed size during iteration" into the engine.
    The worker is held inside its walk (at an entry's path) while the put lands."""
    from spilld.entries import Entry

    at_path, go = threading.Event(), threading.Event()

    class HeldEntry(Entry):
        def __getattribute__(self, name: str) -> Any:
            if name == "path" and threading.current_thread() is not threading.main_thread() and not go.is_set():
                at_path.set()
                go.wait(10)
            return object.__getattribute__(self, name)

    s = Store(tmp_path, block_tokens=0, disk_cap=1 << 40)
    await s.put([7, *range(100, 130)], two_kv(31), IDENT)
    await s.put([7, *range(200, 230)], two_kv(31), IDENT)
    s.entries[0].__class__ = HeldEntry

    async def put_meanwhile() -> None:
        await asyncio.to_thread(at_path.wait, 10)
        await s.put([7, *range(300, 330)], two_kv(31, 5), IDENT)  # the same namespace and first token
        go.set()

    meanwhile = asyncio.ensure_future(put_meanwhile())
    try:
        got = await s.lookup_async(IDENT, "", [7, *range(100, 140)])
    finally:
        go.set()
        await meanwhile
    assert isinstance(got, Hit) and got.matched == 31 and at_path.is_set()


@pytest.mark.asyncio
async def test_a_block_record_replaced_while_a_restore_reads_is_never_missing(tmp_path: Path) -> None:
    """Found in review: taking another writer's block record out and putting ours in left a moment without the key;
    a restore resolving block paths on a worker then read it as a lost block and quarantined a good manifest. The
    loop is held right after the old record's bytes are counted out, while the worker asks for the path."""
    worker_in, gap, read_done = threading.Event(), threading.Event(), threading.Event()
    s = Store(tmp_path, block_tokens=16, disk_cap=1 << 40)
    tokens = list(range(500, 540))
    await s.put(tokens, two_kv(40), IDENT)
    (entry,) = s.entries
    first = entry.blocks[0]
    s.disown_files()  # a Spiller that could not hold the folder alone: the files are shared
    real_path, real_count = s.block_path, s.index._count

    def block_path(key: bytes) -> Any:
        if key == first and not read_done.is_set():
            worker_in.set()
            gap.wait(10)
            try:
                return real_path(key)
            finally:
                read_done.set()
        return real_path(key)

    def count(path: str, nbytes: int, *, block: bool) -> None:
        real_count(path, nbytes, block=block)
        if block and nbytes < 0 and threading.current_thread() is threading.main_thread() and not read_done.is_set():
            gap.set()
            read_done.wait(10)

    s.block_path = block_path  # type: ignore[method-assign]
    s.index._count = count  # type: ignore[method-assign]
    restore = asyncio.ensure_future(s.restore_async(Hit(entry, 39), IDENT))
    await asyncio.to_thread(worker_in.wait, 10)
    await s.put(tokens[:16] + list(range(900, 924)), two_kv(40, 7), IDENT)  # writes its own copy of block 0
    got = await restore
    assert isinstance(got, spilld.Loaded) and s.entry_at(entry.path) is entry and s.counters.quarantined == 0


@pytest.mark.asyncio
async def test_a_put_cancelled_while_it_stops_its_cut_ahead_leaves_no_block_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a cancel that landed in the wait for the cut started ahead (after every block was written
    and pinned) skipped the put's unpin: its blocks stayed pinned, never reclaimed until a restart."""
    from spilld.store import store as store_module

    closing = asyncio.Event()

    async def slow_close(self: Any) -> None:
        closing.set()
        await asyncio.sleep(5)

    monkeypatch.setattr(store_module._Ahead, "close", slow_close)
    s = Store(tmp_path, block_tokens=16, disk_cap=1 << 40)
    put = asyncio.ensure_future(s.put(list(range(40)), two_kv(40), IDENT))
    await asyncio.wait_for(closing.wait(), 10)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    await s.delete_doomed_async()
    assert s.count == 0 and len(s.blocks) == 0  # nothing names them: reclaimed
    assert [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".spilld-block")] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("which", ["manifest", "block"])
async def test_a_link_swapped_in_for_a_stored_file_is_never_read(tmp_path: Path, which: str) -> None:
    """Found in review: only the scan refused symbolic links; a restore opened an indexed name through a link
    someone put there afterwards, and served whatever file it pointed at. Now every read of the store's own files
    refuses a link: a miss, and the file it points at is left as it was."""
    root, theirs = tmp_path / "store", tmp_path / "theirs"
    theirs.mkdir()
    s = Store(root, disk_cap=2**40, block_tokens=16)
    r = await s.put(toks(40), kv_layers(40), IDENT)
    hit = s.lookup(IDENT, "", toks(40))
    assert isinstance(hit, Hit)
    victim = r.path if which == "manifest" else next(b.path for b in s.index.blocks.values())
    copy = theirs / os.path.basename(victim)
    shutil.copyfile(victim, copy)  # the same bytes: only the link itself is wrong
    os.unlink(victim)
    os.symlink(copy, victim)
    got = await s.restore_async(hit, IDENT)
    assert isinstance(got, Miss)
    assert os.path.islink(victim) and os.listdir(theirs) == [copy.name] and quarantined(root) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("which", ["manifest", "block"])
async def test_a_client_restore_never_reads_a_link_swapped_in_for_a_stored_file(tmp_path: Path, which: str) -> None:
    """Found in review: the link refusal covered the daemon's and a Spiller's own reads, but a daemon's client reads
    the hit's files itself, and its load served the file a link put in place of the manifest or a block pointed at.
    It is a miss there too, and the file pointed at is left as it was."""
    from spilld.client import AsyncClient
    from spilld.daemon import Daemon
    from tests.daemons import cleanup, new_root, quiet_config

    root = new_root()
    cfg = quiet_config(root, block_tokens=16)
    daemon = Daemon(cfg)
    await daemon.start()
    try:
        async with AsyncClient(cfg.socket, identity=IDENT, name="reader") as c:
            assert (await c.spill(toks(40), kv_layers(40), droppable=False)).stored
            assert await c.load(toks(40)) is not None
            store = daemon.store
            victim = store.entries[0].path if which == "manifest" else next(iter(store.index.blocks.values())).path
            theirs = tmp_path / os.path.basename(victim)
            shutil.copyfile(victim, theirs)  # the same bytes: only the link itself is wrong
            os.unlink(victim)
            os.symlink(theirs, victim)
            assert await c.load(toks(40)) is None
        assert os.path.islink(victim) and os.listdir(tmp_path) == [theirs.name]
    finally:
        await daemon.stop()
        cleanup(root)
