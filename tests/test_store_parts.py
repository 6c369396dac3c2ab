"""The store's parts on their own, without a disk where they need none: its index, the eviction order, the files
to unlink, the folder claims, the pins file and the quarantine's caps."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import blocks, fileio
from spilld.entries import Entry
from spilld.saver import plan
from spilld.store.eviction import evict_order
from spilld.store.folders import FolderClaims, remove_empty_folders
from spilld.store.index import Index
from spilld.store.listing import EXT
from spilld.store.pins import PINS_FILE, read_pins, write_pins
from spilld.store.quarantine import trim_quarantine
from spilld.store.scan import scan_root
from spilld.store.store import Store
from spilld.store.unlinks import Unlinks
from tests.caches import fill

IDENT = spilld.Identity("model-p", "cfg-p", "tok-p", "")
B = 16


def _cut(tokens: list[int], seed: int = 0) -> blocks.Split:
    cut = blocks.split(*plan(tokens, [fill(C.KVCache(), len(tokens), seed=seed)], identity=IDENT), B)
    assert cut is not None
    return cut


def _add(index: Index, cut: blocks.Split, path: str, when: float = 0.0) -> Entry:
    for i, key in enumerate(cut.keys):
        if key not in index.blocks:
            index.add_block(key, f"/r/fp/ns/{key.hex()}.blk", 1000 + i)
    manifest = cut.manifest()[0]
    manifest.file_size = 500  # what the save reports; its bytes on disk are counted from it
    return index.add(path, manifest, when)


def test_the_index_counts_shared_blocks_once_and_hands_back_the_ones_an_entry_named() -> None:
    index = Index()
    a = _add(index, _cut(list(range(40))), "/r/fp/ns/a.spilld")
    b = _add(index, _cut([*range(32), 99, 98, 97]), "/r/fp/ns/b.spilld")  # shares its first two blocks with a
    assert len(a.blocks) == len(b.blocks) == 2 and a.blocks == b.blocks
    assert index.block_bytes == 1000 + 1001  # each block counted once
    assert index.total_bytes == 1000 + 1001 + 500 + 500 == index.namespace_bytes("ns")
    assert index.by_last[a.blocks[-1]] == {a.path: a, b.path: b}
    assert index.leading_blocks([*a.blocks, b"\0" * 32]) == 2 and index.leading_blocks([b"\0" * 32]) == 0

    named = index.remove(a)
    assert [r.key for r in named] == a.blocks and all(r.refs == {b.path} for r in named)
    assert index.remove(a) == []  # not indexed any more: nothing to hand back twice
    assert index.by_last[a.blocks[-1]] == {b.path: b}
    index.remove(b)
    assert all(not r.refs for r in named) and a.blocks[-1] not in index.by_last
    for rec in named:
        assert index.drop_block(rec) and not index.drop_block(rec)
    assert index.total_bytes == 0 and index.namespace_bytes("ns") == 0 and index.by_path == {}


def test_an_entry_without_blocks_is_found_by_its_first_token() -> None:
    index = Index()
    header, _ = plan(list(range(5, 25)), [fill(C.KVCache(), 20)], identity=IDENT)
    header.file_size = 700
    e = index.add("/r/fp/ns/w.spilld", header, 0.0)
    assert e.blocks == [] and list(index.by_start.values()) == [{e.path: e}] and index.total_bytes == 700
    assert index.remove(e) == [] and index.by_start == {} and index.total_bytes == 0


def _entry(path: str, last_used: float, nbytes: int = 10) -> Entry:
    return Entry(path, "fp", "", np.zeros(4, np.uint32), nbytes, True, 0, last_used)


def test_the_eviction_order_is_lru_with_the_newest_pins_that_fit_last() -> None:
    everyone = [_entry("new", 3), _entry("pin_old", 0), _entry("old", 1), _entry("pin_new", 2.5), _entry("mid", 2)]
    pinned = {"pin_old", "pin_new"}
    parts = lambda e: (e.nbytes, {e.path.encode(): e.nbytes})  # noqa: E731 (an entry and a block of its own)
    names = lambda cap: [e.path for e in evict_order(everyone, pinned, parts, cap)]  # noqa: E731
    assert names(40) == ["old", "mid", "new", "pin_old", "pin_new"]
    # room for one pin: the newest keeps its place at the end, the older one goes by age like the rest
    assert names(20) == ["pin_old", "old", "mid", "new", "pin_new"]
    assert names(19) == ["pin_old", "old", "mid", "pin_new", "new"]  # none fits: plain LRU
    # two pins sharing a block: it counts once against the cap (found in review: twice, and a pin that fit went)
    shared = lambda e: (e.nbytes, {b"system": 100, e.path.encode(): e.nbytes})  # noqa: E731
    assert [e.path for e in evict_order(everyone, pinned, shared, 140)][-2:] == ["pin_old", "pin_new"]


def test_a_kept_file_is_unlinked_only_after_its_last_release() -> None:
    u = Unlinks()
    u.add("a")
    u.add("b")
    u.keep("b")
    u.keep("b")
    assert u.take() == ["a"]
    assert u.take() == []
    u.release("b")
    assert u.take() == []  # one keep left
    u.release("b")
    assert u.take() == ["b"]
    u.add("c.blk")
    u.add("d")
    u.forget_where(lambda p: p.endswith(".blk"))
    assert u.take() == ["d"]


def test_the_sweep_leaves_claimed_folders_and_their_model_folder(tmp_path: Path) -> None:
    fp1, fp2, fp4 = "00000000000000f1", "00000000000000f2", "00000000000000f4"  # spilld's names: 16 hex digits
    ns1, ns3 = "00000000000000a1", "00000000000000a3"
    for d in (f"{fp1}/{ns1}", f"{fp1}/base", f"{fp2}/{ns3}", ".quarantine", "inbox", "projects/drafts", f"{fp2}/mine"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / f"{fp2}/{ns3}/x.spilld").write_bytes(b"x")
    (tmp_path / fp4).mkdir()
    claims = FolderClaims()
    claims.claim(str(tmp_path / f"{fp1}/{ns1}"))
    claims.claim(str(tmp_path / f"{fp4}/00000000000000a4"))  # a save about to make its folder: its model's stays
    remove_empty_folders(str(tmp_path), claims)
    users = ["inbox", "projects", "projects/drafts"]  # not spilld's names: never removed (found in review: they were)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == sorted([
        ".quarantine", fp1, f"{fp1}/{ns1}", fp2, f"{fp2}/{ns3}", f"{fp2}/{ns3}/x.spilld", f"{fp2}/mine", fp4, *users
    ])  # fmt: skip
    claims.release(str(tmp_path / f"{fp1}/{ns1}"))
    claims.release(str(tmp_path / f"{fp4}/00000000000000a4"))
    remove_empty_folders(str(tmp_path))  # no claims: every empty one of spilld's
    assert not (tmp_path / fp1).exists() and not (tmp_path / fp4).exists() and (tmp_path / f"{fp2}/{ns3}").exists()
    assert all((tmp_path / u).is_dir() for u in users) and (tmp_path / f"{fp2}/mine").is_dir()


def test_the_pins_file_names_nothing_outside_the_root(tmp_path: Path) -> None:
    root = str(tmp_path)
    write_pins(root, [os.path.join(root, "fp/ns/a.spilld")], fileio.DEFAULT_OPS, fileio.Durability.FSYNC)
    assert read_pins(root) == [os.path.join(root, "fp/ns/a.spilld")]
    (tmp_path / PINS_FILE).write_text("fp/ns/b.spilld\n/etc/passwd\n../x.spilld\nfp/../../y\n\n")
    assert read_pins(root) == [os.path.join(root, "fp/ns/b.spilld")]
    (tmp_path / PINS_FILE).write_bytes(b"\xff\xfe")  # not text: no pins, no error
    assert read_pins(root) == []


def test_a_pins_file_past_its_bound_loses_its_cut_name_not_a_wrong_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a file longer than PINS_MAX_BYTES was cut mid-name, and the cut name was taken."""
    from spilld.store import pins

    root = str(tmp_path)
    (tmp_path / PINS_FILE).write_text("fp/ns/a.spilld\nfp/ns/b.spilld\n")
    monkeypatch.setattr(pins, "PINS_MAX_BYTES", len("fp/ns/a.spilld\nfp/ns/b.spil"))
    assert read_pins(root) == [os.path.join(root, "fp/ns/a.spilld")]
    monkeypatch.setattr(pins, "PINS_MAX_BYTES", len("fp/ns/a.spilld\nfp/ns/b.spilld\n"))  # exactly: all of it
    assert read_pins(root) == [os.path.join(root, "fp/ns/a.spilld"), os.path.join(root, "fp/ns/b.spilld")]


def test_the_quarantine_keeps_the_newest_within_its_count_and_bytes(tmp_path: Path) -> None:
    """Only files named as spilld names what it moves there count and go (found in review: any name was removed)."""
    theirs = ["0001-notes.txt", "0002-x.spilld", "0003-y.spilld-block"]  # a user's file, a folder, a symbolic link
    (tmp_path / theirs[0]).write_bytes(b"x" * 1000)
    (tmp_path / theirs[1]).mkdir()
    os.symlink(tmp_path / theirs[0], tmp_path / theirs[2])
    for i in range(6):
        (tmp_path / f"{1000 + i}-f{i}{EXT}").write_bytes(b"x" * 100)
    assert trim_quarantine(str(tmp_path), keep=4, cap_bytes=10_000) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [*theirs, *(f"{1000 + i}-f{i}{EXT}" for i in range(2, 6))]
    assert trim_quarantine(str(tmp_path), keep=4, cap_bytes=250) == 2  # bytes bound it too
    assert sorted(p.name for p in tmp_path.iterdir()) == [*theirs, f"1004-f4{EXT}", f"1005-f5{EXT}"]


def _check_index(index: Index) -> None:
    """Every sum and cross-reference of ``index`` rebuilt from its entries and blocks."""
    entries, recs = list(index.by_path.values()), list(index.blocks.values())
    assert index.entry_bytes == sum(e.nbytes for e in entries)
    assert index.block_bytes == sum(r.nbytes for r in recs)
    assert sum(index.ns_bytes.values()) == index.total_bytes
    for rec in recs:
        assert rec.refs == {e.path for e in entries if rec.key in e.blocks}
    last = {(e.blocks[-1], e.path) for e in entries if e.blocks}
    assert {(k, p) for k, group in index.by_last.items() for p in group} == last
    assert all(group for group in [*index.by_last.values(), *index.by_start.values()])  # no empty group kept
    heads = {(e.blocks[0], e.path) for e in entries if e.blocks and e.trimmable}
    assert {(k, p) for h in index.heads.values() for k, g in h.groups.items() for p in g} == heads
    for h in index.heads.values():  # no empty one kept; the order names each group once, sorted
        assert h.groups and all(h.groups.values()) and sorted(h.order) == h.order
        assert sorted(k for _, k in h.order) == sorted(h.groups)
    assert sum(len(g) for g in index.by_start.values()) == sum(1 for e in entries if not e.blocks)


def test_the_index_stays_consistent_through_random_adds_and_removes() -> None:
    """A model check: random puts (shared prefixes, some without blocks), removals, and blocks dropped once no
    entry names them, as the store does; after every step the index's sums and references are rebuilt and
    compared."""
    rng = np.random.default_rng(7)
    base = list(range(100, 164))
    cuts = [_cut(base[: 16 * n] + [900 + n] * 5, seed=n) for n in (1, 2, 3, 4)]
    cuts += [_cut([*base[:16], 7, 7, 7, 7, *base[20:40]], seed=9)]
    plain = [plan([5, 6, *range(n)], [fill(C.KVCache(), n + 2)], identity=IDENT)[0] for n in (8, 12)]
    for h in plain:
        h.file_size = 300
    index, n, spares_dropped = Index(), 0, 0
    for _ in range(300):
        op = rng.integers(3)
        if op == 0:  # a put: its blocks first, then the manifest
            n += 1
            kind = rng.integers(5)
            if kind == 0:
                index.add(f"/r/fp/ns/p{n}.spilld", plain[rng.integers(len(plain))], float(n))
            elif kind == 1:  # it failed after its blocks: they are indexed, named by nothing
                for key in cuts[rng.integers(len(cuts))].keys:
                    if key not in index.blocks:
                        index.add_block(key, f"/r/fp/ns/{key.hex()}.blk", 1234)
            else:
                _add(index, cuts[rng.integers(len(cuts))], f"/r/fp/ns/m{n}.spilld", float(n))
        elif op == 1 and index.by_path:  # an eviction: the entry, then the blocks nothing names now
            paths = sorted(index.by_path)
            e = index.by_path[paths[rng.integers(len(paths))]]
            for rec in index.remove(e):
                if not rec.refs:
                    assert index.drop_block(rec)
        elif op == 2:  # a block no entry names (a put that failed after writing it) goes
            spare = [r for r in index.blocks.values() if not r.refs]
            if spare:
                assert index.drop_block(spare[rng.integers(len(spare))])
                spares_dropped += 1
        _check_index(index)
    assert n > 50 and index.by_path and spares_dropped > 5  # the walk did add, keep and reclaim


def test_the_scan_reports_bad_files_and_reaps_only_when_it_may(tmp_path: Path) -> None:
    """``scan_root`` indexes blocks by name, reports a bad entry file without touching it, and removes temp files
    and a second copy of a block (both read and found good: two puts wrote it) only with ``reap`` (the caller holds
    the folder's lock)."""
    r = asyncio.run(Store(tmp_path, block_tokens=B).put(list(range(B + 4)), [fill(C.KVCache(), B + 4)], IDENT))
    assert r.header.blocks is not None
    key, folder = r.header.blocks.keys[0], Path(os.path.dirname(r.path))
    os.unlink(r.path)  # its block is left, named by no manifest
    first = next(folder.iterdir())
    size = first.stat().st_size
    shutil.copy(first, folder / blocks.block_name(key))  # the same block written twice
    (folder / f".x{fileio.TEMP_SUFFIX}").write_bytes(b"t")
    (folder / "bad.spilld").write_bytes(b"not a header")
    for reap in (False, True):
        found = scan_root(str(tmp_path), fileio.DEFAULT_OPS, reap)
        assert list(found.index.blocks) == [key] and found.index.block_bytes == size
        assert [(os.path.basename(p), type(e).__name__) for p, e in found.bad] == [("bad.spilld", "BadMagic")]
        assert found.orphans == list(found.index.blocks.values())  # no manifest names it
        left = sorted(p.name for p in folder.iterdir())
        assert found.reaped_temp == (1 if reap else 0)
        assert len(left) == (2 if reap else 4) and "bad.spilld" in left  # the store moves bad files, not the scan


def test_a_folder_that_goes_while_a_store_is_walked_is_skipped(tmp_path: Path, refuse_listing: Any) -> None:
    """A running store's sweep removes an empty folder between a walk's check and its listing (found in review:
    `verify --dir` then exited 70 with FileNotFoundError). Every walk of a store skips it."""
    from spilld.cli.files import store_files
    from spilld.store import list_entries

    gone = tmp_path / "0123456789abcdef" / "base"
    gone.mkdir(parents=True)
    refuse_listing(gone, FileNotFoundError(2, "No such file or directory", str(gone)))
    assert store_files(str(tmp_path)) == [] and list_entries(str(tmp_path)) == []
    assert scan_root(str(tmp_path), fileio.DEFAULT_OPS, True).index.blocks == {}
