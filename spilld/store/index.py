"""A store's index in memory: what it holds and where, and the bytes that adds up to on disk. No I/O.

The index says which entries and blocks lose their place; the store decides what happens to their files.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import blocks
from .. import format as fmt
from ..codecs.rules import cut_floor
from ..entries import Block, Entry, identity_fingerprint
from ..matching import Heads, start_key


def ns_dir(path: str) -> str:
    """The namespace folder a stored file sits in (what a namespace quota counts)."""
    return os.path.basename(os.path.dirname(path))


def _pop(groups: dict[Any, dict[str, Entry]], where: Any, path: str) -> None:
    group = groups.get(where)
    if group is not None:
        group.pop(path, None)
        if not group:
            del groups[where]


class Index:
    """Entries by path; the lookup groups (entries without blocks by (namespace, first token), entries with blocks
    by their last block); prefix blocks by key, each with the entries that name it; the layouts stored per prompt
    space; and the bytes on disk, in all and per namespace folder, each block once (what the caps count).

    Changed only on the thread that owns the store (its event loop); a lookup reads it from anywhere."""

    def __init__(self) -> None:
        self.by_path: dict[str, Entry] = {}
        self.by_start: dict[tuple[str, int], dict[str, Entry]] = {}  # (namespace, first token): lookup candidates
        self.blocks: dict[bytes, Block] = {}
        self.by_last: dict[bytes, dict[str, Entry]] = {}  # entries with blocks, by their last block
        self.heads: dict[tuple[str, str, str], Heads] = {}  # those that can be cut, per prompt space: by first block
        self.checkpoints: dict[str, dict[str, Entry]] = {}  # generation checkpoints, by their namespace (their key)
        self.roots: dict[tuple[str, str, str], dict[bytes, tuple[int, bool]]] = {}  # layouts per prompt space
        self.entry_bytes = 0  # running sums: the cap is checked on every put
        self.block_bytes = 0
        self.ns_bytes: Counter[str] = Counter()  # per namespace folder name (its hash)

    @property
    def total_bytes(self) -> int:
        return self.entry_bytes + self.block_bytes

    def add(self, path: str, header: fmt.Header, last_used: float, *, owned: bool = True, bulk: bool = False) -> Entry:
        """Index the file at ``path`` (its header read and checked); every block it names must be indexed.
        ``owned``: see ``Entry.owned``. ``bulk`` (a scan's adds, before anyone looks up): the lookup order of
        ``heads`` is left unsorted until ``sort_heads`` (found in review: one sorted insert each is quadratic; 300,000
        first blocks took 6.0 s of inserts, one sort of them 0.3 s)."""
        b = header.blocks
        held = header.restorable_tokens
        e = Entry(
            path=path,
            fingerprint=identity_fingerprint(header.identity),
            namespace=header.identity.namespace,
            tokens=np.asarray(header.tokens, dtype=np.uint32),
            nbytes=header.file_size,
            trimmable=header.trimmable,
            min_reusable=cut_floor(header),
            last_used=last_used,
            checkpoint=header.checkpoint,
            codec_provider=header.codec_provider,
            blocks=list(b.keys) if b else [],
            block_size=b.size if b else 0,
            whole=blocks.whole(header),
            attachments=bool(header.attachments),
            restorable=held if held < len(header.tokens) else None,
            owned=owned,
        )
        if b is not None:
            for k in b.keys:
                self.blocks[k].refs.add(path)
                self.blocks[k].namespace, self.blocks[k].named = e.namespace, True
            roots = self.roots.setdefault((e.fingerprint, e.namespace, e.codec_provider), {})
            root = blocks.header_root(header, b.size)
            # whole once any whole manifest was indexed under it: a layout's positional leaves may be shared by one
            # that is not (found in review: the last one indexed set it, and hid the blocks-only hits of the other)
            roots[root] = (b.size, e.whole or roots.get(root, (0, False))[1])
        self.by_path[path] = e
        self._count(path, e.nbytes, block=False)
        if e.checkpoint is not None:
            self.checkpoints.setdefault(e.namespace, {})[path] = e
        if e.blocks:  # found through its chain; supersede finds it through its last block
            self.by_last.setdefault(e.blocks[-1], {})[path] = e
            if e.trimmable:  # and by its first block, by a prompt sharing less than a block with it
                self.heads.setdefault((e.fingerprint, e.namespace, e.codec_provider), Heads()).add(e, sort=not bulk)
        else:
            self.by_start.setdefault(start_key(e.namespace, e.tokens), {})[path] = e
        return e

    def remove(self, e: Entry) -> list[Block]:
        """``e`` out of the index (if it is the entry indexed at its path): the blocks it named, each without its
        reference now (those no entry names any more are the caller's to reclaim)."""
        if self.by_path.get(e.path) is not e:
            return []
        del self.by_path[e.path]
        self._count(e.path, -e.nbytes, block=False)
        if e.checkpoint is not None:
            _pop(self.checkpoints, e.namespace, e.path)
        if e.blocks:
            _pop(self.by_last, e.blocks[-1], e.path)
            space = (e.fingerprint, e.namespace, e.codec_provider)
            if (heads := self.heads.get(space)) is not None and heads.remove(e):
                del self.heads[space]
        else:
            _pop(self.by_start, start_key(e.namespace, e.tokens), e.path)
        named = []
        for k in e.blocks:
            if (rec := self.blocks.get(k)) is not None:
                rec.refs.discard(e.path)
                named.append(rec)
        return named

    def sort_heads(self) -> None:
        """Put the lookup order of ``heads`` right after ``add(..., bulk=True)``."""
        for heads in self.heads.values():
            heads.sort()

    def add_block(self, key: bytes, path: str, nbytes: int, *, owned: bool = True) -> Block:
        """A block not indexed yet (its key is new), named by no entry so far."""
        assert key not in self.blocks, "a block is indexed once"
        rec = self.blocks[key] = Block(key, path, nbytes, owned=owned)
        self._count(path, nbytes, block=True)
        return rec

    def replace_block(self, old: Block, path: str, nbytes: int) -> Block:
        """``old`` (indexed) replaced by a file of the same block at ``path``, in one store of the key: a restore
        reading block paths on a worker never finds the key missing between a drop and an add (found in review:
        it read the gap as a lost block and quarantined a good manifest)."""
        new = Block(old.key, path, nbytes, set(old.refs), old.pins, old.namespace, old.named)
        self.blocks[old.key] = new
        self._count(old.path, -old.nbytes, block=True)
        self._count(path, nbytes, block=True)
        return new

    def drop_block(self, rec: Block) -> bool:
        """``rec`` out of the index, if it is the block indexed under its key (False: it was not)."""
        if self.blocks.get(rec.key) is not rec:
            return False
        del self.blocks[rec.key]
        self._count(rec.path, -rec.nbytes, block=True)
        return True

    def block_of(self, e: Entry, path: str | None) -> Block | None:
        """The block of ``e`` stored at ``path`` (the file a failed read names), if it is one."""
        return next((r for k in e.blocks if (r := self.blocks.get(k)) is not None and r.path == path), None)

    def leading_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a chain, in order) are indexed as this store's own, from the first on."""
        return next((i for i, k in enumerate(keys) if not self.owns(k)), len(keys))

    def owns(self, key: bytes) -> bool:
        """Block ``key`` is indexed and ours to reuse (``Block.owned``)."""
        rec = self.blocks.get(key)
        return rec is not None and rec.owned

    def namespace_bytes(self, folder: str) -> int:
        """Bytes on disk under one namespace folder name (all models; each of its blocks once)."""
        return self.ns_bytes[folder]

    def _count(self, path: str, nbytes: int, *, block: bool) -> None:
        if block:
            self.block_bytes += nbytes
        else:
            self.entry_bytes += nbytes
        self.ns_bytes[ns_dir(path)] += nbytes
