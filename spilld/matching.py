"""A lookup's match of a prompt against the index, computed on any thread from a snapshot of it (``Query``):
entries with blocks through their key chain, the others through their first token."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from . import blocks
from .admission import prefix_digests
from .entries import Block, Entry, Hit


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def start_key(namespace: str, tokens: np.ndarray) -> tuple[str, int]:
    """Where an entry sits in the lookup index: only entries sharing a prompt's first token can match it."""
    return namespace, int(tokens[0]) if len(tokens) else -1


def head_bytes(tokens: np.ndarray) -> bytes:
    """Token ids as big-endian u32: the bytes of two sequences sort as the sequences do (``Heads``)."""
    return np.ascontiguousarray(tokens, dtype=">u4").tobytes()


class Heads:
    """The entries with blocks of one prompt space (identity, namespace, codec provider) that can be cut, by their
    first block: a prompt that shares less than a block with them reaches them through no chain. The first blocks'
    tokens are kept in order (``order``), so those that share most with a prompt sit beside it there: a bisect,
    then a walk outwards, compares a few of them whatever their number. Changed on the store's loop; a lookup on a
    worker thread copies ``order`` in one call (a consistent view) when it needs it."""

    def __init__(self) -> None:
        self.groups: dict[bytes, dict[str, Entry]] = {}  # by first block key: the entries that name it first
        self.order: list[tuple[bytes, bytes]] = []  # (its tokens, ``head_bytes``; its key) of each group, sorted
        self.longest = 0  # tokens of the longest first block (stores of another block size may have left some)

    def add(self, e: Entry, *, sort: bool = True) -> None:
        """``e`` in; ``sort=False`` (a scan's many adds) appends its group unsorted: ``sort`` puts them in order once."""
        key = e.blocks[0]
        if key not in self.groups:
            self.groups[key] = {}
            self.longest = max(self.longest, e.block_size)
            item = (head_bytes(e.tokens[: e.block_size]), key)
            if sort:
                bisect.insort(self.order, item)
            else:
                self.order.append(item)
        self.groups[key][e.path] = e

    def sort(self) -> None:
        self.order.sort()

    def remove(self, e: Entry) -> bool:
        """``e`` out (if it is in); True once no entry is left."""
        key = e.blocks[0]
        group = self.groups.get(key)
        if group is not None and group.get(e.path) is e:
            del group[e.path]
            if not group:
                del self.groups[key]
                i = bisect.bisect_left(self.order, (head_bytes(e.tokens[: e.block_size]), key))
                del self.order[i]
        return not self.groups


@dataclass
class Found:
    """What a comparison of a prompt against candidate entries found (computed on any thread)."""

    best: Hit | None = None
    untrimmable: bool = False
    foreign: bool = False
    codec: bool = False  # an entry of this identity, but written by another codec provider
    evicted: bool = False
    asked: list[bytes] = field(default_factory=list)  # the write gate's digests of the prompt's prefixes

    @property
    def matched(self) -> int:
        """Tokens the best hit so far serves (0: none yet)."""
        return self.best.matched if self.best is not None else 0


@dataclass
class Query:
    """A lookup's inputs, taken from the index on its own thread; ``match`` reads only these (and the block
    index, with single reads that are safe from any thread)."""

    want: np.ndarray
    fp: str
    provider_id: str
    by_start: dict[str, Entry]
    evicted: list[np.ndarray]
    roots: list[tuple[bytes, int, bool]]  # (root key, block size, whole) of the layouts stored for this prompt
    blocks: dict[bytes, Block]
    by_path: dict[str, Entry]
    by_last: dict[bytes, dict[str, Entry]]  # entries with blocks, by their last block
    ask: tuple[str, int] | None = None  # the write gate's scope and block size: the prompt's asks are hashed here
    heads: Heads | None = None  # this prompt space's entries with blocks that can be cut, by their first block

    def chains(self) -> list[tuple[int, list[Block], bool]]:
        """Per stored layout, the longest run of its blocks that starts the prompt: (block size, its blocks, whole).
        Its deepest blocks may be named by no manifest yet (a put between its blocks and its manifest)."""
        out = []
        toks = self.want
        for root, size, whole in self.roots:
            key, walked = root, list[Block]()
            while (len(walked) + 1) * size <= len(toks) - 1:  # one token must be left to compute
                i = len(walked)
                key = blocks.next_key(key, toks[i * size : (i + 1) * size])
                rec = self.blocks.get(key)
                if rec is None:
                    break
                walked.append(rec)
            if walked:
                out.append((size, walked, whole))
        return out

    def match(self) -> Found:
        """Entries with blocks are found through their chain (O(prompt / B) probes, then the manifests naming its
        last block or ending on one of its blocks, then, while a shallower one could serve more, those leaving it
        inside a block), entries without through the first-token index; a whole layout's chain alone is a hit too,
        as deep as a whole manifest names it."""
        found = Found()
        if self.ask is not None:
            scope, size = self.ask
            found.asked = prefix_digests(scope, self.want, size, len(self.want) // size)
        limit = len(self.want) - 1
        chains = self.chains()
        # the loop's own dict, read on a worker: taken whole in one call (a put changing it mid-loop raised here)
        candidates = {e.path: e for e in list(self.by_start.values())}
        for _, walked, _ in chains:
            candidates |= self._along(walked)
        self._compare(found, list(candidates.values()), limit)
        for size, walked, _ in chains:
            self._shallower(found, size, walked, candidates, limit)
        self._under_a_block(found, {walked[0].key for _, walked, _ in chains}, limit)
        for size, walked, whole in chains:
            if whole:
                self._blocks_only(found, size, walked)
        if found.best is None:  # would an entry we evicted have served this prompt? (explains the miss)
            found.evicted = any(common_prefix(t, self.want) > 0 for t in self.evicted)
        return found

    def _along(self, walked: list[Block]) -> dict[str, Entry]:
        """The entries a chain can serve: those naming its last block, and those whose own chain ends on one of
        its blocks (their tail runs on from there). Not every entry naming a shared block: a system prompt's are
        named by every conversation under it. Found in review: with the last block's manifests only, an entry
        that ended earlier (the previous turn, while this turn's put wrote its blocks; or the trimmable turn
        before an untrimmable one) was never compared."""
        out = {p: e for p in list(walked[-1].refs) if (e := self.by_path.get(p)) is not None}
        for rec in walked:
            out |= {e.path: e for e in list(self.by_last.get(rec.key, {}).values())}
        return out

    def _shallower(self, found: Found, size: int, walked: list[Block], seen: dict[str, Entry], limit: int) -> None:
        """Walking back from the chain's last block, while one could beat ``found``: the entries that leave the chain
        inside the next block (they name this one, not the next), those not compared yet. Found in review: an entry
        sharing 40 tokens lost to one sharing 16, as every entry naming the deeper blocks was untrimmable."""
        for depth in range(len(walked) - 1, 0, -1):
            # one naming block `depth` but not the next shares fewer than (depth + 1) * size tokens, or holds fewer
            if found.best is not None and found.best.matched >= (depth + 1) * size:
                return
            left = walked[depth - 1].refs - walked[depth].refs  # (one C call: the loop cannot change them meanwhile)
            self._compare(found, [e for p in left if p not in seen and (e := self.by_path.get(p)) is not None], limit)

    def _under_a_block(self, found: Found, walked: set[bytes], limit: int) -> None:
        """The entries with blocks whose first block no chain walked: the prompt shares less than that block with them,
        or is no longer than it, so only one that can be cut serves it (``Heads``). Walking outwards from the prompt's
        place in their order, the tokens shared only fall: it stops where they cannot beat ``found``. A group shares
        its first block's tokens, so its first entry that may be cut that far serves as well as any (the same rows).
        Found in review: no chain reached them, so a prompt of at most B tokens missed every entry with blocks, and
        so did one sharing fewer than B tokens with them, though a cut of one served it."""
        if self.heads is None or found.matched >= min(self.heads.longest, limit):  # (none of them could serve more)
            return
        order, groups = list(self.heads.order), self.heads.groups  # (one C call: the loop cannot change it meanwhile)
        at = bisect.bisect_left(order, (head_bytes(self.want[: self.heads.longest]),))
        shared = lambda j: common_prefix(np.frombuffer(order[j][0], dtype=">u4"), self.want)  # noqa: E731
        left, right = at - 1, at
        below = shared(left) if left >= 0 else 0
        above = shared(right) if right < len(order) else 0
        while min(max(below, above), limit) > found.matched:
            if below >= above:
                j, n, left = left, below, left - 1
                below = shared(left) if left >= 0 else 0
            else:
                j, n, right = right, above, right + 1
                above = shared(right) if right < len(order) else 0
            if order[j][1] not in walked:  # (a group whose first block a chain walked was compared through it)
                self._first_usable(found, list(groups.get(order[j][1], {}).values()), min(n, limit))

    @staticmethod
    def _first_usable(found: Found, group: list[Entry], shared: int) -> None:
        """The first of ``group`` (entries that can be cut, sharing ``shared`` tokens with the prompt) that serves
        more than ``found``."""
        for e in group:
            usable = min(shared, e.held)
            if usable > found.matched and usable >= e.min_reusable:
                found.best = Hit(e, usable)
                return

    def _blocks_only(self, found: Found, size: int, walked: list[Block]) -> None:
        """A hit from the chain's blocks alone, at the deepest block a whole manifest names, if it beats ``found``."""
        for depth in range(len(walked), 0, -1):
            if found.best is not None and found.best.matched >= depth * size:
                return
            refs = [e for p in list(walked[depth - 1].refs) if (e := self.by_path.get(p)) is not None and e.whole]
            if refs:
                found.best = Hit(refs[0], depth * size, blocks_only=True)
                return

    def _compare(self, found: Found, candidates: list[Entry], limit: int) -> None:
        for e in candidates:
            usable = min(common_prefix(e.tokens, self.want), limit, e.held)
            if usable <= 0:
                continue
            if e.fingerprint != self.fp or e.codec_provider != self.provider_id:
                found.foreign |= e.fingerprint != self.fp
                found.codec |= e.fingerprint == self.fp
                continue
            if usable < e.ntokens and (not e.trimmable or usable < e.min_reusable):
                found.untrimmable = True
                continue
            best = found.best
            # as many tokens: the one that restores more with them (its attachments: a draft model's KV), then the
            # most recently used
            rank = (usable, e.attachments, e.last_used)
            if best is None or rank > (best.matched, best.entry.attachments, best.entry.last_used):
                found.best = Hit(e, usable)
