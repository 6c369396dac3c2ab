"""A cold tier for mlx-lm's server prompt cache (``LRUPromptCache``).

``ColdTierPromptCache`` is a drop-in ``LRUPromptCache``: every entry the server
inserts is written behind (droppable, so a burst never holds memory); an entry
the LRU evicts before its write-behind was stored is spilled again, this time
not droppable (a write-behind still queued, embedded or in the daemon client's
own queue, is made not droppable instead; one being written or shipped stands
for it if stored, the entry written only if not), and so is every such entry at exit;
a fetch the memory tier cannot answer in full asks spilld for the longest usable
prefix and loads it.
A restarted server therefore starts with what it had (minus anything the
daemon itself had to shed or failed to write).

Run mlx-lm's own server with it (every ``mlx_lm.server`` option works)::

    python -m spilld.integrations.mlx_lm --model PATH              # through the spilld daemon
    python -m spilld.integrations.mlx_lm --model PATH --spilld-dir ~/.cache/spilld-embedded  # no daemon
    python -m spilld.integrations.mlx_lm --model PATH --spilld-dir DIR --spilld-disk-cap 20GiB --spilld-durability none
    python -m spilld.integrations.mlx_lm --model PATH --spilld-dir DIR --spilld-write-budget 20GiB --spilld-admit-after 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from mlx_lm.models.cache import CacheList, LRUPromptCache, PromptTrie

from .. import errors, fileio, mlxthreads
from .. import format as fmt
from ..blocks import DEFAULT_BLOCK_TOKENS
from ..config import (
    OneLineParser,
    arg_type,
    check_admit_after,
    check_block_tokens,
    default_socket,
    format_size,
    parse_duration,
    parse_size,
)
from ..daemon.listen import is_served
from ..identity import config_fingerprint, model_identity
from ..metrics import METRICS_EVERY_S, engine_exposition, write_textfile
from ..queue import DEFAULT_QUEUE_CAP, Outcome, Settled
from ..saver import clone_caches, evaluated
from .tier import ColdTier, DaemonTier, EmbeddedTier, settled_now

# the most a metrics round waits for the embedded tier's loop to read its store's figures (a small part of the round)
STATUS_WAIT_S = 1.0
SERVED_WAIT_S = 2.0  # at start, how long --spilld-dir's lock may stay held alone before it is taken for a daemon's

log = logging.getLogger("spilld.mlx_lm")

TierFor = Callable[[Any], ColdTier | None]

# Evicted caches at once whose spill may not be shed (each the last copy, held in memory until written); past this,
# an evicted cache is spilled droppable: a stalled writer would otherwise hold every cache the LRU let go
LAST_COPIES_HELD = 4


def covered_tokens(tokens: Sequence[int], caches: Sequence[Any]) -> int | None:
    """How many of ``tokens`` the caches hold: the server keys entries with the last, unfed token too.

    None when no cache keeps a position (a pure state-space model): then we cannot
    tell, and such an entry is not spilled rather than risk a shifted restore.
    """
    offsets = [o for c in caches if (o := _offset(c)) is not None]
    return min(min(offsets), len(tokens)) if offsets else None


def _offset(cache: Any) -> int | None:
    """A cache's position, when it keeps one as a number (a batch cache's per-sequence array is not one); a
    ``CacheList``'s is its parts' lowest (it has no offset of its own: found in review, such models never spilled)."""
    if isinstance(cache, CacheList):
        offsets = [o for c in cache.caches if (o := _offset(c)) is not None]
        return min(offsets) if offsets else None
    offset = getattr(cache, "offset", None)
    return offset if isinstance(offset, int) else None


def held_to(caches: Sequence[Any], n: int) -> list[Any] | None:
    """The caches as of their first ``n`` tokens. With a draft model the server's list is the main model's caches
    and the draft's, and the main ones hold a row more after a speculative step: those are cut back, on clones (the
    server's own caches are left as they are). None when such a cache cannot be cut, or when a cache that keeps no
    position (a recurrent state) sits beside one ahead of ``n``: its state may be a token ahead too (found in review)."""
    if all(_offset(c) in (None, n) for c in caches):
        return list(caches)
    out = clone_caches(caches)
    for c in out:
        offset = _offset(c)
        if offset is None:
            return None
        if offset > n:
            if not c.is_trimmable():
                return None
            c.trim(offset - n)
    return out


Key = tuple[Any, tuple[int, ...]]


class _ReportingTrie(PromptTrie):
    """mlx-lm's trie, reporting each entry that leaves it: popped for space (evicted) or as a superseded prefix."""

    def __init__(self, on_evict: Callable[[Any, list[int], Any], None], on_drop: Callable[[Key], None]) -> None:
        super().__init__()
        self._on_evict, self._on_drop = on_evict, on_drop

    def pop(self, model: Any, tokens: list[int]) -> Any:
        entry = super().pop(model, tokens)
        self._on_evict(model, tokens, entry)
        return entry

    def pop_prefixes(self, model: Any, tokens: list[int]) -> list[tuple[int, Any]]:
        popped: list[tuple[int, Any]] = super().pop_prefixes(model, tokens)
        for n, _ in popped:  # a longer trimmable entry covers them; on disk the store supersedes them too
            self._on_drop((model, tuple(tokens[:n])))
        return popped


class ColdTierPromptCache(LRUPromptCache):
    """``LRUPromptCache`` with spilld behind it. ``tier_for(model_key)`` gives the tier of a model (or None).

    Called from the server's generation thread only; the write-behind outcomes arrive on the tier's thread,
    hence the lock around the two records of what is in flight and what is stored.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, tier_for: TierFor) -> None:
        super().__init__(max_size, max_bytes)
        self._tier_for = tier_for
        self._trie = _ReportingTrie(self._evicted, self._forget)  # empty yet: nothing to carry over
        self._lock = threading.Lock()
        self._behind: dict[Key, concurrent.futures.Future[Settled]] = {}  # write-behinds in flight
        self._stored: set[Key] = set()  # entries in the LRU whose write-behind is on disk
        self._last_copies: set[concurrent.futures.Future[Settled]] = set()  # evictions' spills, not droppable
        self._evicting: set[concurrent.futures.Future[Settled]] = set()  # evictions' spills in flight, any kind
        # caches evicted while their tier was still opening (embedded: its folder's scan), spilled once it is open
        self._held: list[tuple[Any, list[int], list[Any]]] = []
        # each cache the server held at exit, by the spill that may store it (see ``unstored_at_exit``)
        self._at_exit: list[concurrent.futures.Future[Settled]] = []
        self.stats = {"restores": 0, "restored_tokens": 0, "cold_misses": 0, "spills": 0, "evictions_spilled": 0}

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        self._spill_held()
        cache, rest = super().fetch_nearest_cache(model, tokens)
        have = len(tokens) - len(rest)
        tier = self._tier_for(model)
        if tier is None or have >= len(tokens) - 1:  # a restore is capped at len - 1: memory cannot be beaten
            return cache, rest
        t0 = time.perf_counter()
        # blocks this thread, as the prefill it replaces would, only shorter; a prefix no longer than what memory
        # gave is neither read nor counted as a hit by the daemon
        try:  # (the tiers never raise; this is for what nobody foresaw: the request goes on regardless)
            loaded = tier.load(tokens, longer_than=have)
        except Exception as exc:
            log.warning("cold-tier lookup failed: %s", exc)
            loaded = None
        n = len(loaded.tokens) if loaded is not None else 0
        if loaded is None or n <= have:
            self.stats["cold_misses"] += 1
            return cache, rest
        self.stats["restores"] += 1
        self.stats["restored_tokens"] += n
        log.info(
            "cold tier: restored %d of %d prompt tokens in %.1f ms", n, len(tokens), 1e3 * (time.perf_counter() - t0)
        )
        return loaded.caches, tokens[n:]

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], **kwargs: Any) -> None:
        self._spill_held()
        self._forget((model, tuple(tokens)))  # a replaced entry: its old record no longer says anything
        self._spill(model, tokens, prompt_cache, droppable=True)  # first: the insert itself may evict it
        super().insert_cache(model, tokens, prompt_cache, **kwargs)

    def spill_unstored(self, timeout: float | None = None) -> int:
        """Spill, not droppable, every entry in memory whose write-behind is not on disk (call before exit, once no
        insert can come). A write-behind still in flight is waited for first, up to ``timeout``, and only one that
        ended not stored (shed, failed) is spilled again: found in review, each was spilled a second time, its tail
        blocks and manifest written twice and the first file then superseded. One still queued at the timeout is
        left to the drain (no spill made now could be written sooner); it is first promoted, made not droppable where
        it stands (``SpillQueue.keep``; through the daemon, while it waits in the client's own queue), so that the
        spills made here, not droppable, never shed it over the queue's cap (found in review: they did, and that
        entry was lost). One the tier cannot promote (shipped to the daemon already, whose queue sheds droppable
        items too) is spilled again, not droppable, held on it by the tier and sent only if the daemon does not
        store it: at exit a second write of an entry is better than its loss, and a second send for nothing worse. A
        daemon that was away is asked again now, whatever its retry wait (found in review: one back inside that wait
        got none of them). How many entries were spilled anew (a promotion, or a spill again in its place, is not
        counted)."""
        n = 0
        for model in {model for lru in self._lru._lrus.values() for model, _ in lru}:
            retry = getattr(self._tier_for(model), "retry_now", None)
            if retry is not None:
                retry()
        self._spill_held()  # (the exit waited for the tiers still opening)
        with self._lock:  # the evicted caches whose spill is still under way are held at exit too
            behind = dict(self._behind)
            self._at_exit = list(self._evicting)
        # (nothing is queued meanwhile: a spill of ours now could make the queue shed one of these)
        concurrent.futures.wait(behind.values(), timeout)
        entries = [(model, tokens) for lru in self._lru._lrus.values() for model, tokens in list(lru)]
        left: list[tuple[Any, list[int]]] = []
        for model, tokens in entries:  # first the write-behinds that stand: none of the spills below may shed one
            f = behind.get((model, tuple(tokens)))
            if f is None or (f.done() and not _stored(f)):
                left.append((model, tokens))
            elif f.done():
                self._at_exit.append(f)  # written: its own outcome (the record may lag)
            else:  # queued still: its future then follows it, promoted where the tier can (one being written stands
                # as it is, embedded), else the spill's own (shipped to the daemon: spilled again, sent only if the
                # daemon does not store the write-behind)
                cache = self._trie.get(model, tokens).prompt_cache
                self._at_exit.append(self._spill(model, tokens, cache, droppable=False, behind=f) or f)
        for model, tokens in left:
            if not self._is_stored((model, tuple(tokens))):
                cache = self._trie.get(model, tokens).prompt_cache
                future = self._spill(model, tokens, cache, droppable=False)
                if future is not None:
                    n += 1
                    self._at_exit.append(future)
        return n

    def unstored_at_exit(self) -> tuple[int, int]:
        """Of the caches held at exit (``spill_unstored``'s, and evicted ones whose spill was under way): how many,
        and how many no spill stored (yet: a drain past its timeout cancels what is left). A write-behind shed is
        no loss when the exit's spill of its entry is stored (found in review: with a daemon's write budget spent,
        the droppable write-behinds in flight were shed at exit, and a drain that stored every cache said 'those
        caches are lost')."""
        stored = sum(map(_stored, self._at_exit))
        held = len(self._at_exit) + len(self._held)  # (those evicted while their tier opened, if it never did)
        return held, held - stored

    def _evicted(self, model: Any, tokens: list[int], entry: Any) -> None:
        key = (model, tuple(tokens))
        with self._lock:
            stored, behind = key in self._stored, self._behind.get(key)
        self._forget(key)
        if stored:
            return
        # Not stored (still queued, shed or failed): this is the last copy, so it must not be dropped, unless
        # LAST_COPIES_HELD are waiting for their writes already (memory must stay bounded). A write-behind still
        # queued is kept instead, made not droppable (found in review: both were written, the entry's tail and
        # manifest twice); one the tier cannot keep (shipped to the daemon already) has it spilled again, which the
        # daemon's tier sends only if the daemon does not store the write-behind
        with self._lock:
            keep = len(self._last_copies) + len(self._held) < LAST_COPIES_HELD
        if keep and self._tier_for(model) is OPENING:  # it would refuse the spill, and the cache be lost (found in
            _readable_later(entry.prompt_cache)  # review): held, within the same bound, until the tier is open
            self._held.append((model, tokens, entry.prompt_cache))
            return
        self._spill_last_copy(model, tokens, entry.prompt_cache, keep=keep, behind=behind)

    def _spill_held(self) -> None:
        """Spill, not droppable, the evicted caches held while their tier was opening, once it is open."""
        if not self._held:
            return
        held, self._held = self._held, []
        for model, tokens, caches in held:
            if self._tier_for(model) is OPENING:
                self._held.append((model, tokens, caches))
            else:
                self._spill_last_copy(model, tokens, caches, keep=True)

    def _spill_last_copy(
        self,
        model: Any,
        tokens: list[int],
        caches: list[Any],
        *,
        keep: bool,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> None:
        """An evicted cache's spill, not droppable if ``keep``; followed until written (``_evicting``)."""
        future = self._spill(model, tokens, caches, droppable=not keep, in_lru=False, behind=behind)
        if future is None:
            return
        self.stats["evictions_spilled"] += 1
        with self._lock:
            self._evicting.add(future)
            if keep:
                self._last_copies.add(future)
        future.add_done_callback(self._written)

    def _written(self, f: concurrent.futures.Future[Settled]) -> None:
        with self._lock:
            self._last_copies.discard(f)
            self._evicting.discard(f)

    def _spill(
        self,
        model: Any,
        tokens: list[int],
        caches: list[Any],
        *,
        droppable: bool,
        in_lru: bool = True,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled] | None:
        """Hand the entry to the tier: the future of its outcome, None if it did not take it (not counted). The
        write-behind of an entry ``in_lru`` (a droppable one) is followed: once stored, its eviction spills nothing;
        still queued (``behind``), the tier may keep it in place of this spill."""
        tier = self._tier_for(model)
        try:  # the cold tier must never fail the server's request (its generation loop would end)
            n = covered_tokens(tokens, caches)
            if tier is None or not n or (held := held_to(caches, n)) is None:
                return None
            kw = {} if behind is None else {"behind": behind}
            future = tier.spill(tokens[:n], held, droppable=droppable, **kw)
        except Exception as exc:
            log.warning("spill refused: %s", exc)
            return None
        if future.done() and not future.result().stored:  # refused at once: no daemon, ids a file cannot hold
            if in_lru:
                _readable_later(caches)
            return None
        self.stats["spills"] += 1
        if droppable and in_lru:
            key = (model, tuple(tokens))
            with self._lock:
                self._behind[key] = future
            future.add_done_callback(lambda f: self._settled(key, f))
        return future

    def _settled(self, key: Key, f: concurrent.futures.Future[Settled]) -> None:
        with self._lock:  # only this very write-behind, still current, counts
            if self._behind.get(key) is f:
                del self._behind[key]
                if f.result().stored:
                    self._stored.add(key)

    def _is_stored(self, key: Key) -> bool:
        with self._lock:
            return key in self._stored

    def _forget(self, key: Key) -> None:
        with self._lock:
            self._behind.pop(key, None)
            self._stored.discard(key)


def _stored(f: concurrent.futures.Future[Settled]) -> bool:
    """Whether a spill's future says it is stored (one not settled yet is not)."""
    return f.done() and not f.cancelled() and f.exception() is None and f.result().stored


def _readable_later(caches: list[Any]) -> None:
    """An entry the tier refused stays in memory, to be spilled at exit from another thread: its pending work
    (mlx-lm's batched path inserts lazy copies) is evaluated now, on the engine's thread that built it; the main
    thread cannot (found in review: every such entry was lost at exit)."""
    try:
        evaluated(caches)
    except Exception as exc:  # the engine goes on; the entry is then only lost, as before
        log.warning("an entry the cold tier refused could not be evaluated: %s", exc)


class _Opening:
    """The tier of a model whose folder is still being scanned (embedded): lookups miss and spills are refused on the
    spot, as with a daemon not reached yet, so a request never waits for the scan (the entries it leaves in memory
    are spilled once the tier is ready, at their eviction or at exit; one evicted meanwhile is held for it)."""

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        *,
        droppable: bool = True,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled]:
        return settled_now(Outcome.CANCELLED)

    def load(self, tokens: Sequence[int], *, longer_than: int = 0) -> None:
        return None

    def close(self, timeout: float | None = None) -> None:
        return None


OPENING = _Opening()


class ServerTiers:
    """One tier per model key of mlx-lm's ``ModelProvider``, built when that model is first seen.

    Embedded (``folder``), a tier is a ``Spiller``, whose start scans the folder: that runs on a thread of its own,
    never on the server's generation thread (found in review: the first request waited 1.6 s for the scan of a store
    of 3,000 entries). ``open_ahead`` starts one at server start, before the model is loaded; the first model seen
    takes it and gives it its identity. Until a model's tier is ready, its requests go without a cold tier."""

    def __init__(self, model_provider: Any, *, socket: str | None, folder: str | None, **kwargs: Any) -> None:
        self.provider = model_provider
        self.socket, self.folder, self.kwargs = socket, folder, kwargs
        self.tiers: dict[Any, ColdTier | None] = {}
        # embedded tiers still opening (their scan on a thread of their own), with the identity to give one made without
        self._opening: dict[Any, tuple[concurrent.futures.Future[EmbeddedTier], fmt.Identity | None]] = {}
        self._ahead: concurrent.futures.Future[EmbeddedTier] | None = None  # opened at start, for the first model
        self._last_embedded: EmbeddedTier | None = None  # the embedded tier opened last: the folder's now (metrics)

    def open_ahead(self) -> None:
        """Embedded: start opening the folder now, on a thread of its own, for the first model the server loads."""
        if self.folder is not None and self._ahead is None:
            self._ahead = self._open_in_background()

    def __call__(self, model_key: Any) -> ColdTier | None:
        if model_key not in self.tiers and model_key not in self._opening:
            self.tiers[model_key] = self._make(model_key)
        if model_key in self._opening:
            return self._opened(model_key)
        return self.tiers[model_key]

    def wait_opened(self, timeout: float | None) -> None:
        """Wait (up to ``timeout``) for the tiers still opening, and the one opened at start: at exit, the entries in
        memory are spilled into them."""
        concurrent.futures.wait(self._unopened(), timeout)

    def _unopened(self) -> list[concurrent.futures.Future[EmbeddedTier]]:
        """The tiers still opening: a model's, and the one opened at start that no model took yet."""
        return [f for f, _ in self._opening.values()] + ([self._ahead] if self._ahead is not None else [])

    def _open_in_background(self, ident: fmt.Identity | None = None) -> concurrent.futures.Future[EmbeddedTier]:
        assert self.folder is not None
        folder, kwargs = self.folder, self.kwargs
        future: concurrent.futures.Future[EmbeddedTier] = concurrent.futures.Future()

        def open_tier() -> None:
            t0 = time.monotonic()
            try:
                tier = EmbeddedTier(folder, ident, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
                return
            entries = tier.spiller.store.count
            log.info("cold tier ready: %s scanned in %.2f s (%d entries)", folder, time.monotonic() - t0, entries)
            self._last_embedded = tier
            future.set_result(tier)

        mlxthreads.start_thread(open_tier, "spilld-open", daemon=True)
        return future

    def _opened(self, model_key: Any) -> ColdTier | None:
        """The tier of ``model_key`` once its folder is open (given its identity here), until then ``OPENING``."""
        future, ident = self._opening[model_key]
        if not future.done():
            return OPENING
        del self._opening[model_key]
        try:
            tier = future.result()
            if ident is not None:
                tier.bind(ident)
        except Exception as exc:  # e.g. a folder a daemon took meanwhile: serve without a cold tier, say so once
            log.warning("no cold tier for %r: %s", model_key, exc)
            self.tiers[model_key] = None
            return None
        self.tiers[model_key] = tier
        return tier

    def embedded_status(self, timeout: float) -> dict[str, Any] | None:
        """The queue's and the store's counters of the embedded tier opened last (``EmbeddedTier.status``), from any
        thread, waited for ``timeout`` at most: None through a daemon (its own metrics show its store), before the
        folder is open, or when the tier's loop did not answer in time."""
        opened = self._last_embedded  # (read once: set on the thread that opens a tier)
        return opened.status(timeout) if opened is not None else None

    def identity(self, model_key: Any) -> fmt.Identity:
        p, args = self.provider, self.provider.cli_args
        if p.model_key != model_key or p.model is None:
            raise errors.SpillError(f"model {model_key!r} is not the one loaded")
        model_id = "|".join(str(k) for k in model_key if k)
        kv_bits = getattr(args, "kv_bits", None)
        ident = model_identity(
            p.model, p.tokenizer, model_id=model_id, kv_bits=kv_bits, kv_group_size=args.kv_group_size,
            quantized_kv_start=getattr(args, "quantized_kv_start", None),  # (quantized from there on, if kv_bits)
        )  # fmt: skip
        draft = getattr(p, "draft_model", None)
        if draft is None:
            return ident
        # an entry holds the draft model's caches beside the main one's: its weights are the entry's too (found in
        # review: a draft updated in place under the same path was restored the old draft's rows, and crashed)
        both = f"{ident.config_fingerprint}|draft {config_fingerprint(draft)}"
        return dataclasses.replace(ident, config_fingerprint=hashlib.sha256(both.encode()).hexdigest()[:16])

    def _make(self, model_key: Any) -> ColdTier | None:
        """The tier of a model seen for the first time; embedded, it is opened on a thread (``_opening``)."""
        try:
            ident = self.identity(model_key)  # here, on the engine's thread: a lazily loaded model is evaluated
            if self.folder is None:
                return DaemonTier(self.socket, ident, **self.kwargs)
        except Exception as exc:  # e.g. a model no longer the one loaded: serve without a cold tier, say so once
            log.warning("no cold tier for %r: %s", model_key, exc)
            return None
        if self._ahead is not None:  # the first model seen: the folder opened at start, given its identity once open
            self._opening[model_key] = (self._ahead, ident)
            self._ahead = None
        else:
            self._opening[model_key] = (self._open_in_background(ident), None)
        return None

    def close(self, timeout: float | None = None) -> None:
        """Drain and close every tier within one ``timeout`` for all; one that fails to close does not keep the
        others open. A tier still opening at the timeout is closed once open (its queue is empty: no request had it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_opened(timeout)
        for key in list(self._opening):
            self._opened(key)  # open by now: among the tiers
        tiers: dict[Any, ColdTier | None] = dict(self.tiers)
        for key in self._opening:
            log.warning("the cold tier of %r was still opening at the timeout: its entries in memory are lost", key)
        left = self._unopened()
        self._opening.clear()
        self._ahead = None
        for i, future in enumerate(left):
            if future.done() and future.exception() is None:
                tiers[f"(no model yet {i})"] = future.result()  # opened, and no request had it
            else:
                future.add_done_callback(_close_once_open)
        for key, tier in tiers.items():
            if tier is None:
                continue
            try:
                tier.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception:
                log.exception("closing the cold tier of %r failed", key)


def drain_at_exit(cache: ColdTierPromptCache, tiers: ServerTiers, timeout: float) -> None:
    """Spill every cache not on disk, drain the tiers within ``timeout``, and say at warning how many of the caches
    held at exit no spill stored (found in review: with the daemon stopped, those spilled at exit were dropped at
    the timeout and the log said nothing). The tiers' own reports are not that count: they include write-behinds
    shed by design (a write budget, a full queue) whose entries the exit spilled again, and stored."""
    end = time.monotonic() + timeout
    tiers.wait_opened(timeout)  # a tier still scanning: its entries go there
    unstored = cache.spill_unstored(max(0.0, end - time.monotonic()))
    log.info("draining the cold tier (%d more entries; up to %.0f s)", unstored, timeout)
    tiers.close(max(0.0, end - time.monotonic()))
    held, lost = cache.unstored_at_exit()
    if lost:
        log.warning(
            "the cold tier did not store %d of the %d caches held at exit (failed, shed, or still queued at the "
            "timeout); those caches are lost", lost, held,
        )  # fmt: skip


def _close_once_open(future: concurrent.futures.Future[EmbeddedTier]) -> None:
    if future.exception() is None:
        future.result().close(0)


def _parser() -> argparse.ArgumentParser:
    # a bad value of ours is one line and exit 2, as the daemon's (found in review: argparse's usage block came
    # first); mlx-lm's own options are refused by its parser, as `mlx_lm.server` refuses them
    parser = OneLineParser(
        prog="python -m spilld.integrations.mlx_lm",
        description="mlx-lm's HTTP server with spilld as the cold tier of its prompt cache. "
        "Every other option is mlx_lm.server's own (see `mlx_lm.server --help`).",
        add_help=False,
    )
    size = arg_type(parse_size, "size")
    parser.add_argument("--spilld-socket", metavar="PATH", help=f"the daemon's socket (default {default_socket()})")
    parser.add_argument(
        "--spilld-dir", metavar="FOLDER", help="no daemon: write the files from this process, into this folder"
    )
    parser.add_argument(
        "--spilld-cap",
        type=size,
        default=None,
        metavar="SIZE",
        help="soft cap on this process's queued spills in memory, as the daemon's --cap: with --spilld-dir the "
        "writes queued, else the spills not yet sent to the daemon (default "
        f"{format_size(DEFAULT_QUEUE_CAP)}; e.g. 512MiB, 2G, 10GB)",
    )
    parser.add_argument(
        "--spilld-disk-cap",
        type=size,
        default=None,
        metavar="SIZE",
        help="with --spilld-dir: cap on the folder's size, as the daemon's --disk-cap (default: the smaller of "
        "64 GiB and a quarter of the free space plus the store's own bytes)",
    )
    parser.add_argument(
        "--spilld-durability",
        default=None,
        choices=[d.value for d in fileio.Durability],
        help="with --spilld-dir: as the daemon's --durability, full (F_FULLFSYNC on macOS), fsync (default) or none",
    )
    parser.add_argument(
        "--spilld-block-tokens",
        type=_int_arg(check_block_tokens),
        default=None,
        metavar="N",
        help="with --spilld-dir: tokens per prefix block, as the daemon's --block-tokens: conversations that share a "
        f"prefix share its blocks on disk, and a turn writes only its new blocks ({fmt.MIN_BLOCK_TOKENS} to "
        f"{fmt.MAX_BLOCK_TOKENS}, default {DEFAULT_BLOCK_TOKENS}; 0 writes every entry whole)",
    )
    parser.add_argument(
        "--spilld-write-budget",
        type=size,
        default=None,
        metavar="SIZE",
        help="with --spilld-dir: bytes written a day, at most, as the daemon's --write-budget (e.g. 20GiB): past it "
        "the write-behinds are shed, an evicted cache's spill still written; the count is kept across "
        "restarts in the folder (default: no budget)",
    )
    parser.add_argument(
        "--spilld-admit-after",
        type=_int_arg(check_admit_after),
        default=None,
        metavar="N",
        help="with --spilld-dir: the write gate, as the daemon's --admit-after: a write-behind's new blocks are "
        "written only once a lookup asked for their prefix this many times (one-off prompts never reach the disk), "
        "an evicted cache's spill always; the counts are kept in memory (default 0: off)",
    )
    parser.add_argument(
        "--spilld-drain-timeout",
        type=arg_type(parse_duration, "duration"),
        default=30.0,
        metavar="DURATION",
        help="at exit, how long to wait for queued spills (default 30 s; e.g. 90, 2m)",
    )
    parser.add_argument(
        "--spilld-metrics-file",
        default=None,
        metavar="PATH",
        help=f"write the cold tier's counters (Prometheus text) to this file every {METRICS_EVERY_S:g} s, atomically; "
        "with --spilld-dir its store's figures too, named as the daemon's metrics",
    )
    return parser


def _int_arg(check: Callable[[int], int]) -> Callable[[str], int]:
    """A whole number checked by ``check`` (the daemon's ``Config`` check), as an argparse type: one that is not a
    number is argparse's own error, as the daemon's ``type=int`` options say it; one ``check`` refuses names it."""

    def convert(text: str) -> int:
        n = int(text)  # (a ValueError here: argparse says "invalid int value")
        try:
            return check(n)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = "int"
    return convert


def absolute_paths(opts: argparse.Namespace) -> None:
    """The integration's paths, absolute and with ``~`` expanded, as the daemon's own (found in review: a quoted
    '~/x', or --spilld-dir=~/x, wrote into a folder named '~' under the current one)."""
    for name in ("spilld_dir", "spilld_socket", "spilld_metrics_file"):
        if (path := getattr(opts, name)) is not None:
            setattr(opts, name, os.path.abspath(os.path.expanduser(path)))


# the folder's own settings: a daemon's are its options. Each is the Spiller's argument of the name after
# "spilld_" (the daemon's option of that name: --disk-cap, --write-budget...)
EMBEDDED_ONLY = (
    "spilld_disk_cap", "spilld_durability", "spilld_block_tokens", "spilld_write_budget", "spilld_admit_after"
)  # fmt: skip


def tier_options(opts: argparse.Namespace) -> dict[str, Any]:
    """The tiers' settings from the integration's options (``ServerTiers``' keyword arguments): the queue's cap for
    either tier; for the embedded one, the folder's cap, durability, block size, write budget and write gate. A
    daemon's folder is set by the daemon's own options: given without --spilld-dir, they are refused (exit 2)
    rather than ignored."""
    given = [name for name in EMBEDDED_ONLY if getattr(opts, name) is not None]
    if given and not opts.spilld_dir:
        ours = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        theirs = ", ".join(f"--{name.removeprefix('spilld_').replace('_', '-')}" for name in given)
        _refuse(
            f"{ours} without --spilld-dir: the daemon's folder is set by its own options (spilld {theirs}); give "
            "--spilld-dir, or leave them out"
        )
    kwargs: dict[str, Any] = {name.removeprefix("spilld_"): getattr(opts, name) for name in given}
    if opts.spilld_cap is not None:
        kwargs["queue_cap"] = opts.spilld_cap
    if opts.spilld_durability is not None:
        kwargs["durability"] = fileio.Durability(opts.spilld_durability)
    return kwargs


def _served(folder: str) -> int | None:
    """The pid (0 if unknown) of the spilld holding ``folder``'s lock alone for ``SERVED_WAIT_S`` (a daemon, for its
    life; a Spiller's scan lets go sooner), else None. Found in review: the embedded tier, made on the first request,
    waited a minute on the generation thread for a daemon's folder, then served without a cold tier."""
    from ..lockfile import LOCK_NAME, FileLock, holder_pid

    if not os.path.isdir(folder):
        return None
    lock = FileLock(os.path.join(folder, LOCK_NAME), f"the folder {folder}")
    end = time.monotonic() + SERVED_WAIT_S
    try:
        while not lock.try_acquire(shared=True):
            if time.monotonic() >= end:
                return holder_pid(lock.path) or 0
            time.sleep(0.05)
    except errors.SpillError:  # a folder that cannot be locked: the tier says why when it is made
        return None
    finally:
        lock.release()
    return None


def _check_folder(folder: str) -> None:
    """Refuse (exit 2) a --spilld-dir that cannot be made a folder. Found in review: the tier is made on the first
    request, so the server started, logged 'files in FOLDER', and served every request without a cold tier after
    one warning (a path under a file, a folder it may not create)."""
    try:
        fileio.make_dirs(fileio.DEFAULT_OPS, folder, fileio.Durability.FSYNC)
    except errors.SpillError as exc:
        _refuse(f"--spilld-dir {folder}: {exc}")


def _refuse(message: str) -> NoReturn:
    print(f"spilld.integrations.mlx_lm: {message}", file=sys.stderr)
    raise SystemExit(2)


def describe_tier(socket: str | None, folder: str | None) -> str:
    """What the start-up line says: the folder written in-process, or the daemon's socket and whether it answers."""
    if folder is not None:
        return f"cold tier: embedded (no daemon), files in {folder}"
    path = socket or default_socket()
    if is_served(path):
        return f"cold tier: the spilld daemon at {path} (answers)"
    return f"cold tier: the spilld daemon at {path} (does not answer yet: every lookup misses until it does)"


def _write_counters_every(path: str, cache: ColdTierPromptCache, stop: threading.Event, tiers: ServerTiers) -> None:
    """The integration's counters as a Prometheus textfile, rewritten until ``stop`` (then once more). Embedded, the
    file also holds the store's figures under the daemon's names (no daemon's file shows them); a round whose tier
    did not answer within ``STATUS_WAIT_S`` has the integration's counters alone."""
    failing = unread = False
    while True:
        stopping = stop.wait(METRICS_EVERY_S)
        try:
            status = tiers.embedded_status(STATUS_WAIT_S)
            unread = False
        except Exception as exc:  # the file must not stop for it: that round goes without the store's figures
            if not unread:
                log.warning("cannot read the embedded tier's status for %s: %s", path, exc)
            unread, status = True, None
        try:
            write_textfile(path, engine_exposition(dict(cache.stats), status))
            failing = False
        except OSError as exc:
            if not failing:
                log.warning("cannot write %s: %s", path, exc)
            failing = True
        if stopping:
            return


def main(argv: Sequence[str] | None = None) -> None:
    """Start ``mlx_lm.server`` with a ``ColdTierPromptCache`` in place of its ``LRUPromptCache``."""
    import mlx.core as mx
    from mlx_lm import server

    parser = _parser()
    opts, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    absolute_paths(opts)
    if opts.spilld_dir and opts.spilld_socket:
        _refuse("--spilld-dir (no daemon) and --spilld-socket (a daemon) exclude each other: give one")
    if opts.spilld_dir and (pid := _served(opts.spilld_dir)) is not None:
        _refuse(
            f"--spilld-dir {opts.spilld_dir} is served by a daemon (pid {pid or 'unknown'}): give its socket "
            "(--spilld-socket), or another folder"
        )
    options = tier_options(opts)
    if opts.spilld_metrics_file and not os.path.isdir(os.path.dirname(os.path.abspath(opts.spilld_metrics_file))):
        _refuse(f"--spilld-metrics-file {opts.spilld_metrics_file}: its folder does not exist")
    if {"-h", "--help"} & set(rest):
        parser.print_help()
        print("\nmlx_lm.server's options follow.\n")
    state: dict[str, Any] = {}

    def run(host: str, port: int, model_provider: Any, **kwargs: Any) -> None:
        if opts.spilld_dir:  # once mlx-lm took its options: a usage error creates nothing (found in review)
            _check_folder(opts.spilld_dir)
        group = mx.distributed.init()
        log.info(describe_tier(opts.spilld_socket, opts.spilld_dir))  # mlx-lm's server has set up logging by now
        state["starting"] = True  # a stop signal from here is held until the generator is kept (``on_stop``)
        tiers = state["tiers"] = ServerTiers(
            model_provider, socket=opts.spilld_socket, folder=opts.spilld_dir, **options
        )
        tiers.open_ahead()  # embedded: the folder's scan runs meanwhile, on a thread of its own
        prompt_cache = state["cache"] = ColdTierPromptCache(model_provider.cli_args.prompt_cache_size, tier_for=tiers)
        if opts.spilld_metrics_file:
            args = (
                os.path.abspath(opts.spilld_metrics_file),
                prompt_cache,
                state.setdefault("stop", threading.Event()),
                tiers,
            )
            state["metrics"] = mlxthreads.start_thread(lambda: _write_counters_every(*args), "spilld-metrics")
        generator = state["generator"] = server.ResponseGenerator(model_provider, prompt_cache)
        state["starting"] = False
        if state.get("stopping"):  # a stop that came while starting: now the generator can be stopped and joined
            raise KeyboardInterrupt
        if group.rank() == 0:
            server._run_http_server(host, port, generator, **kwargs)  # a stop signal ends its generation first
        else:
            try:
                generator.join()
            except KeyboardInterrupt:  # (found in review: the drain ran beside a generation still decoding, exit 1)
                generator.stop_and_join()  # as rank 0's server does, before the cold tier drains

    def on_stop(signum: int, frame: Any) -> None:
        if state.setdefault("stopping", False):  # a second Ctrl-C or SIGTERM must not cut the stop short
            log.warning("already stopping (%s): the server's requests end, then the cold tier drains", signum)
            return
        state["stopping"] = True
        # Raised inside ResponseGenerator(), it would lose the generator whose thread has started: that thread
        # ran on through the drain (found in review). ``run`` raises it once the generator is kept.
        if not state.get("starting"):
            raise KeyboardInterrupt  # mlx-lm's server stops cleanly on it; then our queue drains

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    server.run = run  # type: ignore[assignment]  # mlx-lm's own run, with our prompt cache
    sys.argv = [parser.prog, *rest]  # mlx-lm's usage and errors name this command (found in review: 'mlx_lm.py')
    code: int | str | None = 0
    try:
        server.main()
    except SystemExit as exc:  # --help, or a usage error
        code = exc.code
    except KeyboardInterrupt:  # a stop before mlx-lm's serving loop could take it: a stop all the same (found in
        # review: SIGTERM as the server started logged 'mlx_lm.server failed' with a traceback, and exit was 1)
        log.info("stopped before serving")
        if "generator" in state:
            state["generator"].stop_and_join()
    except BaseException:
        log.exception("mlx_lm.server failed")
        code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # nothing may cut the drain short
            signal.signal(sig, signal.SIG_IGN)
        try:
            if "tiers" in state:
                drain_at_exit(state["cache"], state["tiers"], opts.spilld_drain_timeout)
                log.info("cold tier counters: %s", dict(state["cache"].stats))
        except Exception:
            log.exception("draining the cold tier failed")
            code = code or 1
        finally:
            if "metrics" in state:
                state["stop"].set()
                state["metrics"].join()
    # Everything is drained: skip the interpreter's teardown, where mlx-lm's server aborts about half the
    # time (std::terminate; plain `mlx_lm server` does it too on this version).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 2)


if __name__ == "__main__":
    main()
