"""A lookup's match of a prompt against the index, computed on any thread from a snapshot of it (``Query``):
entries with blocks through their key chain, the others through their first token."""

from __future__ import annotations

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


@dataclass
class Found:
    """What a comparison of a prompt against candidate entries found (computed on any thread)."""

    best: Hit | None = None
    untrimmable: bool = False
    foreign: bool = False
    codec: bool = False  # an entry of this identity, but written by another codec provider
    evicted: bool = False
    asked: list[bytes] = field(default_factory=list)  # the write gate's digests of the prompt's prefixes


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
