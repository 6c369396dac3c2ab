"""The store's side of the remote tier: push what the store wrote, and fill the store from the tier when a lookup
finds more of a prompt's chain there than on the local disk.

What is pushed, per entry stored with blocks: the blocks it names that the tier lacks (``b:<key>``; asked first, so a
block a failed or skipped push left out is pushed with the next entry that names it), its manifest under the key of
its last block (``m:<key>``), for each block pushed the key of that manifest (``p:<key>``: a prompt that ends
inside another conversation finds a manifest naming its blocks), and its layout's root key under the layout space
(``r:<space>``: a host with an empty disk cannot compute a root key, which hashes the cache layout). All are written
only if absent (SET NX): shared prefixes are uploaded once by the fleet. One entry's pushes are queued at a time,
in the order the entries were stored, each waiting for room in the push queue rather than dropping the ones before
it: a chain with a block missing is of no use past that block.

A fill probes the chain of the prompt's block keys (one round trip), fetches the manifest that ends where the
remote chain ends (or one that names that block), then the blocks it names that this store lacks, and hands them to
``Store.adopt``, which checks every byte before keeping anything. Every failure is a miss and a counter. A fill is
optional work, as a droppable spill is: none is fetched once the day's write budget is spent, nor while the write
gate has not admitted the prefix it would write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import socket
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from .. import blocks, errors
from .. import format as fmt
from ..assemble import Expected
from ..config import Config
from ..entries import CHECKPOINT_NS_PREFIX, Block, Entry, identity_fingerprint, token_array
from ..lease import off_loop
from ..store import Store
from ..unpack import unpack
from ..validate import header_from_bytes
from .breaker import State
from .config import RemoteConfig
from .keys import BLOCK_KEY_BYTES, Kind
from .stats import Reason
from .tier import MAX_EVENT_KEYS, EventKind, RemoteTier, one_failure

log = logging.getLogger("spilld.remote")

PUSH_MODES = ("all", "evicted", "none")  # every entry stored with blocks; those the disk evicts; none: fetch only
EVICTED_IN_FLIGHT = 8  # evicted entries whose files are kept for their push at once (more are not pushed)
# Entries waiting for their turn to push (one pushes at a time): past this the oldest waiting one is skipped (its
# blocks go with a later entry that names them). The tier's push queue bounds the bytes; this, the tasks.
PUSHES_WAITING = 16
MAX_FILL_BLOCKS = 4096  # blocks one fill fetches at most (a manifest naming more is not fetched: a miss)
# Blocks a fill fetches per batch: the store checks and writes one batch while the next is fetched, so a fill holds
# two batches in memory, not the whole prefix (8B-shaped blocks of 64 tokens are 8 MiB: 128 MiB)
FILL_BATCH_KEYS = 8
FILL_BATCH_BYTES = 64 * 1024**2  # ... and fewer when its blocks are larger: a batch holds about this many bytes
# The largest block a fill fetches (a 70B-shaped block of 256 tokens is 80 MiB); the bound a manifest implies for
# its blocks is its own shapes', which a hostile value sets (found in review: 64 GiB a block): larger is a miss
MAX_FILL_BLOCK_BYTES = 256 * 1024**2
# Fetches and adopts under way at once (each holds up to two batches and a manifest); a lookup that finds none free
# is a miss ("busy"), never a wait. Lookups of one prompt at once share one fill, and fills that reach the same last
# block share its fetch (found in review: N lookups of a new prompt fetched and adopted N copies)
FILLS_AT_ONCE = 2
# Refusals that say the bytes are a newer writer's (a rolling upgrade), not wrong: a miss here, never removed
NEWER_WRITER = (errors.UnsupportedVersion, errors.CodecVersionUnsupported, errors.CodecProviderMismatch)
ROOT_KEPT_S = 300.0  # a root fetched from the remote tier is used this long, then read again
# A manifest fetched, checked and refused for a reason that leaves it on the tier (more blocks than a fill takes,
# blocks larger than it reads, a newer writer's file): a lookup that reaches it again misses at once, by the same
# reason, for this long, rather than fetch it again (found in review: every lookup of such a prompt fetched the
# manifest again, up to 256 MiB, to refuse it again). Then it is read again: one put there meanwhile is used.
REFUSED_KEPT_S = 60.0
REFUSED_KEPT_KEYS = 1024  # manifests remembered so at most; past it the oldest refusal is forgotten
MAX_ROOT_VALUE_BYTES = 64  # a namespace's root value: msgpack of [32-byte key, bool], 36 bytes; longer is hostile
# A manifest's header (at most 64 MiB) and its tail (rows under one block, and any non-positional state): a value
# larger than this is refused unread. A block's bound comes from its manifest (``_named_blocks``).
MAX_MANIFEST_VALUE_BYTES = 256 * 1024 * 1024
BLOCK_HEADER_SLACK = 4096  # a block's header beside block 0's as planned: its own key, time and hashes
# A fill's block that could not be fetched, by the tier's reason: its fill miss (an absent block: evicted, or lost)
UNFETCHED: dict[Reason, str] = {r: f"blocks_{r.value}" for r in Reason if r is not Reason.OOM}
# A fill a read on its way gave nothing for (the root, the probe, the manifest or its reference), the value not absent
# but unread or refused: its fill miss, by the tier's reason (found in review: with Redis down or hung every fill
# said ``no_root`` or ``no_longer_chain``, as though nothing had been pushed)
UNREAD: dict[Reason, str] = {r: r.value for r in Reason if r not in (Reason.ABSENT, Reason.OOM)}
# A start's announcement of what the scan found (``RemoteLink.announce_held``): one event of up to ``MAX_EVENT_KEYS``
# block keys at a time, this long apart (a store of 250,000 blocks: 245 events, a few seconds); one that failed, or
# while the tier takes no writes, is tried again this long after (and a namespace whose event failed, said again:
# ``RemoteLink._say_again``)
ANNOUNCE_PAUSE_S = 0.01
ANNOUNCE_RETRY_S = 1.0
# Namespaces whose ``reset`` this run remembers (sent, or being sent) past which a lookup sends none: a client names
# any namespace it likes. A namespace with blocks to announce (stored, filled, found by the scan) is reset whatever
# the count: its ``stored`` events wait for its reset.
RESET_NAMESPACES_MAX = 4096
_SPACE_DOMAIN = "spilld-remote-roots/1"


def _shared(namespace: str) -> bool:
    """Whether the shared tier takes a namespace's entries and events: not a generation's checkpoints, which only
    ``resume`` on the host that wrote them reads (a lookup, and so a fill, never asks for them). Found in review:
    each checkpoint was pushed whole (its blocks chain from a root of its own namespace, so none is shared with its
    conversation's), under a namespace of its own that no host reads, with an events stream of its own that nothing
    trims away: a stream key left on the server for every generation, and every block and manifest for good without
    a TTL."""
    return not namespace.startswith(CHECKPOINT_NS_PREFIX)


def root_space(fingerprint: str, namespace: str, provider: str, size: int) -> bytes:
    """The key under which a layout's root key is kept: what a lookup knows (model, namespace, codecs, B)."""
    blob = msgpack.packb([_SPACE_DOMAIN, fingerprint, namespace, provider, size], use_bin_type=True)
    return hashlib.sha256(blob).digest()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class Turns:
    """Turns taken one at a time, in order; at most ``limit`` wait, and past that the oldest waiting is told at once
    that it is skipped (its task ends then, not after every turn before it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.skipped = 0
        self._busy = False
        self._waiting: deque[asyncio.Future[bool]] = deque()

    async def take(self) -> bool:
        """Wait for the turn: True once it is ours (``give`` it back), False if skipped."""
        if not self._busy and not self._waiting:
            self._busy = True
            return True
        me: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append(me)
        if len(self._waiting) > self.limit:
            self._waiting.popleft().set_result(False)
            self.skipped += 1
        try:
            return await me
        except asyncio.CancelledError:
            if me in self._waiting:
                self._waiting.remove(me)
            elif me.done() and not me.cancelled() and me.result():
                self.give()  # handed the turn as it was cancelled: pass it on
            raise

    def give(self) -> None:
        """The turn is done: the next waiting takes it."""
        while self._waiting:
            if not (nxt := self._waiting.popleft()).done():
                nxt.set_result(True)
                return
        self._busy = False


class _Absent(Exception):
    """A block the manifest names could not be fetched while a fill fetched it: ``reason`` says why (absent: evicted
    or lost; or a read that failed: timeout, down, refused, decrypt, bad_bytes)."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class _Refused(Exception):
    """A manifest a fill would fetch was refused lately (``RemoteLink.refusal``): the fill misses at once, by ``why``."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class RemoteLink:
    """Binds a ``RemoteTier`` to a ``Store``: registered as its listener (pushes), and asked by lookups (fills)."""

    def __init__(
        self,
        tier: RemoteTier,
        store: Store,
        push: str = "all",
        host: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if push not in PUSH_MODES:
            raise ValueError(f"remote push is one of {', '.join(PUSH_MODES)}, not {push!r}")
        self.tier, self.store, self.push = tier, store, push
        self.host = host or socket.gethostname()
        self._roots: dict[bytes, tuple[bytes, bool]] = {}  # layout space -> (root key, whole): pushed or fetched
        self._root_read: dict[bytes, float] = {}  # when a fetched root was read (monotonic): read again after a while
        self._pushing: set[asyncio.Task[Any]] = set()  # pushes being read and queued, events being published
        self._gone: dict[str, list[bytes]] = {}  # blocks reclaimed this loop turn, by namespace
        self._evicting: set[asyncio.Task[Any]] = set()  # evicted entries being read and queued
        self._turns = Turns(PUSHES_WAITING)  # one entry's pushes queued at a time, in the order they were stored
        self.evicted_skipped = 0  # evicted entries not pushed: too many in flight, or the tier not taking pushes
        self.pushes_too_large = 0  # entries not pushed: a block larger than any host's fill reads (said once, logged)
        self.fills = 0  # manifests (and their blocks) kept from the remote tier
        self.fill_misses: Counter[str] = Counter()  # fills tried and not done, by why
        self.fills_shared = 0  # lookups that waited for a fill of the same prompt already under way
        self._fetching = 0  # fetches and adopts under way (at most FILLS_AT_ONCE)
        self._filling: dict[tuple[str, str, str, bytes], asyncio.Future[bool]] = {}  # under way, by prompt
        self._adopting: dict[bytes, asyncio.Future[bool]] = {}  # under way, by the last block asked for
        self._clock = clock
        # manifests refused and left on the tier, by (namespace, key): (when, the fill miss, for too_many_blocks the
        # first of its blocks this host lacked), the oldest first
        self._refused: OrderedDict[tuple[str, bytes], tuple[float, str, bytes | None]] = OrderedDict()
        self._announcing: asyncio.Task[None] | None = None  # what the start found, being announced
        self._reset: set[str] = set()  # namespaces whose ``reset`` of this run is on their stream (``_reset_first``)
        self._resetting: dict[str, asyncio.Lock] = {}  # namespaces whose reset is being sent, or failed: one at a time
        self._unsaid: set[str] = set()  # namespaces an event failed for: reset and announced again (``_say_again``)
        self._saying_again: asyncio.Task[None] | None = None
        store.listeners.append(self)  # with push "none" too: its events still tell routers what it holds

    # --- push ---------------------------------------------------------------------------------------------

    def stored(self, entry: Entry, written: list[Block], root: bytes) -> None:
        """A store listener: queue the pushes of ``entry`` (its files are read off the loop); with ``evicted``,
        only say on the stream that this host holds its new blocks. Not a generation's checkpoint (``_shared``)."""
        if not _shared(entry.namespace):
            return
        with one_failure():  # its event, probes and the worker's batches of its pushes count one failure at most
            self._spawn(self._stored(entry, list(written), root), self._pushing)

    def adopted(self, entry: Entry, fetched: list[Block]) -> None:
        """A store listener: a fill kept ``entry``; say on the stream that this host holds the blocks it fetched
        (never pushed back: they came from the tier). Found in review: a host that filled a prefix was never
        announced as holding it, so no router sent it that prefix's prompts, and its eviction later announced blocks
        it had never been said to hold."""
        if fetched and _shared(entry.namespace):
            self._spawn(self._said_held(entry.namespace, [r.key for r in fetched]), self._pushing)

    def evicted(self, entry: Entry, named: list[Block]) -> None:
        """A store listener: with ``evicted``, push the entry and the blocks it names, its files kept from their
        unlink until they are read (at most ``EVICTED_IN_FLIGHT`` entries at once; a tier not taking pushes
        gets none)."""
        if self.push != "evicted" or not entry.blocks or not _shared(entry.namespace):
            return
        if len(self._evicting) >= EVICTED_IN_FLIGHT or not self.tier.taking_pushes:
            self.evicted_skipped += 1
            return
        kept = {entry.path, *(rec.path for rec in named)}
        for p in kept:
            self.store.keep_file(p)
        with one_failure():  # as a stored entry's push: one failure at most
            task = self._spawn(self._push_evicted(entry, named, kept), self._evicting)
        # a task cancelled before its first step (the link closing) never runs its ``finally``: what it kept goes
        task.add_done_callback(lambda _: self._let_go_all(kept))

    def _let_go_all(self, kept: set[str]) -> None:
        for p in list(kept):
            kept.discard(p)
            self.store.release_file(p)

    def _spawn(self, work: Any, into: set[asyncio.Task[Any]]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        into.add(task)
        task.add_done_callback(into.discard)
        return task

    async def _stored(self, entry: Entry, written: list[Block], root: bytes) -> None:
        if written:  # what this host holds now, whatever becomes of the push (and before a later eviction's event)
            await self._said_held(entry.namespace, [r.key for r in written])
        if self.push == "all":
            await self._push(entry, self.store.named_blocks(entry), root)

    async def _push_evicted(self, entry: Entry, named: list[Block], kept: set[str]) -> None:
        def let_go(path: str) -> bool:  # read, or not needed: its unlink need not wait for the rest of the push
            if path not in kept:
                return False
            kept.remove(path)
            self.store.release_file(path)
            return True

        try:
            manifest = await off_loop(functools.partial(_read, entry.path), background=True)
            let_go(entry.path)
            # a header and a key chain of up to 64 MiB: checked off the loop, as a put's (found in review)
            header = await off_loop(functools.partial(header_from_bytes, manifest, len(manifest)), compute=True)
            await self._push(entry, named, blocks.header_root(header, entry.block_size), manifest, let_go)
        except (OSError, errors.SpillError) as exc:  # not readable: nothing of it is pushed
            log.debug("evicted entry %s not pushed: %s", entry.path, exc)
        finally:
            self._let_go_all(kept)
            await self.store.delete_doomed_async()

    async def _let_go_now(self, let_go: Callable[[str], bool], path: str) -> None:
        """``let_go(path)``; a file it no longer kept is unlinked now (the disk over its cap meanwhile)."""
        if let_go(path):
            await self.store.delete_doomed_async()

    async def _push(
        self,
        entry: Entry,
        recs: list[Block],
        root: bytes,
        manifest: bytes | None = None,
        let_go: Callable[[str], bool] = lambda _: False,
    ) -> bool:
        """In its turn, offer those of ``recs`` the tier lacks (each with a reference to the entry's last block),
        then the entry's manifest and its layout's root: False if a file could not be read (evicted or superseded
        meanwhile: what was not read is not pushed), the tier stopped taking pushes, or the push was skipped."""
        if not self.tier.taking_pushes:  # (down, disabled, or its breaker open): every offer would be refused
            return False
        if not await self._turns.take():
            return False  # skipped: newer entries waited behind it (theirs carry its blocks that they name)
        try:
            return await self._push_in_turn(entry, recs, root, manifest, let_go)
        finally:
            self._turns.give()

    async def _push_in_turn(
        self, entry: Entry, recs: list[Block], root: bytes, manifest: bytes | None, let_go: Callable[[str], bool]
    ) -> bool:
        """``let_go(path)`` is told of each block file once it is read, or found not needed (True: it was kept
        for this push, and may go now)."""
        try:  # the manifest first: one superseded meanwhile (its file gone) pushes nothing, never blocks whose
            if manifest is None:  # references would name a manifest the tier will not hold (the next entry heals)
                manifest = await off_loop(functools.partial(_read, entry.path), background=True)
        except OSError:
            return False
        if not await self._fill_would_read(manifest):
            return False
        ns = entry.namespace
        space = root_space(entry.fingerprint, ns, entry.codec_provider, entry.block_size)
        offer = self.tier.offer_in_turn
        # offered with every entry (a few bytes, written only if absent, its TTL refreshed if present): one lost
        # (a restart without persistence, evicted, expired) comes back with the next entry, never left missing
        # until a restart, when every host with an empty disk would miss (found in review)
        if await offer(ns, space, msgpack.packb([root, entry.whole]), Kind.ROOT):
            self._roots[space] = (root, entry.whole)
        last = entry.blocks[-1]
        lacking = await self.tier.absent(ns, [rec.key for rec in recs])
        if lacking is None:
            return False
        todo = set(lacking)
        try:
            for rec in recs:
                if rec.key not in todo:
                    let_go(rec.path)
                    continue
                data = await off_loop(functools.partial(_read, rec.path), background=True)
                await self._let_go_now(let_go, rec.path)
                if not (await offer(ns, rec.key, data) and await offer(ns, rec.key, last, Kind.REF)):
                    return False
        except OSError:
            return False
        if not await offer(ns, last, manifest, Kind.MANIFEST):
            return False
        # the blocks the tier held already: their references now name this entry's manifest, which names them
        # (the one there may name a manifest gone, found in review: prompts ending there missed for good)
        for rec in recs:
            if rec.key not in todo and not await offer(ns, rec.key, last, Kind.REF):
                return False
        return True

    async def _fill_would_read(self, manifest: bytes) -> bool:
        """Whether a fill would fetch the blocks ``manifest`` names: a push judges by the fill's own bound (found
        in review: blocks a little under ``MAX_FILL_BLOCK_BYTES`` were pushed, then refused by every fill, whose
        bound adds header slack and padding). Said once in the log, counted each time."""
        try:
            _, bound = await off_loop(functools.partial(_named_blocks, manifest), compute=True)
        except errors.SpillError:  # (a file changed under the push: nothing of it is pushed)
            return False
        if bound <= MAX_FILL_BLOCK_BYTES:
            return True
        if not self.pushes_too_large:
            log.warning(
                "not pushing to the remote tier: a block may hold up to %d bytes, more than a fill reads (%d); "
                "use a smaller --block-tokens", bound, MAX_FILL_BLOCK_BYTES,
            )  # fmt: skip
        self.pushes_too_large += 1
        return False

    def announce_held(self) -> None:
        """Say on the streams, in the background, that this host holds the blocks its store's scan found (entries
        kept across a restart). Events said so only as each entry was stored or filled (found in review): a host
        that restarted after its events were lost (Redis restarted without persistence, the stream trimmed past
        them) held blocks no router heard of again. Each namespace's reset goes first (``_reset_first``): what its
        streams said this host held and the scan did not find is withdrawn. Nothing is pushed: the tier is a cache
        whose LRU chose what it dropped, and a block it lacks goes with the next entry stored that names it."""
        held = self._held_keys()  # (before the first client is served)
        if held:
            self._announcing = asyncio.get_running_loop().create_task(self._announce(held))

    def _held_keys(self, namespaces: set[str] | None = None) -> dict[str, list[bytes]]:
        """The keys of the named blocks this host holds, by shared namespace; ``namespaces``: of those only, each
        one there even with none. One pass over the store's index, on the loop."""
        held: dict[str, list[bytes]] = {ns: [] for ns in namespaces or ()}
        for rec in self.store.index.blocks.values():
            if rec.named and (rec.namespace in held if namespaces is not None else _shared(rec.namespace)):
                held.setdefault(rec.namespace, []).append(rec.key)
        return held

    async def _announce(self, held: dict[str, list[bytes]]) -> None:
        for ns, keys in held.items():
            for lo in range(0, max(len(keys), 1), MAX_EVENT_KEYS):  # (none held: its reset alone)
                while True:
                    if self.tier.state in ("disabled", "stopped"):
                        return
                    # those still held now: one evicted since the scan had its own event (never said held after)
                    left = [k for k in keys[lo : lo + MAX_EVENT_KEYS] if self._held(k)]
                    # (the namespace's reset goes even when none is left: what its last run held is not held now)
                    if self.tier.taking_pushes:
                        said = self._said_held(ns, left, again=False) if left else self._reset_first(ns)
                        if await said:
                            break
                    await asyncio.sleep(ANNOUNCE_RETRY_S)  # down, or its breaker open: when it answers again
                await asyncio.sleep(ANNOUNCE_PAUSE_S)

    async def _said_held(self, namespace: str, keys: list[bytes], again: bool = True) -> bool:
        """A ``stored`` event of ``keys``, after this run's reset of ``namespace`` (``_reset_first``): False, and
        none sent, while the reset has not gone; with ``again``, a failure has the namespace said again."""
        said = await self._reset_first(namespace) and await self.tier.publish_event(
            EventKind.STORED, namespace, keys, self.host
        )
        if not said and again:
            self._say_again(namespace)
        return said

    async def _said_gone(self, namespace: str, keys: list[bytes]) -> None:
        """An ``evicted`` event of ``keys``; a failure has the namespace said again."""
        if not await self.tier.publish_event(EventKind.EVICTED, namespace, keys, self.host):
            self._say_again(namespace)

    def _say_again(self, namespace: str) -> None:
        """An event of ``namespace`` failed (the tier down, its breaker open): once the tier takes writes again, the
        namespace is reset and what this host holds of it then announced again, in the background. Found in review:
        an ``evicted`` event lost so was never sent again, and routers sent this host the prompts it had evicted
        for the rest of its run (a lost ``stored`` one, the prompts it held went elsewhere)."""
        if self.tier.state in ("disabled", "stopped"):  # (no event goes any more)
            return
        self._unsaid.add(namespace)
        if self._saying_again is None or self._saying_again.done():
            self._saying_again = asyncio.get_running_loop().create_task(self._say_all_again())

    async def _say_all_again(self) -> None:
        while self._unsaid:
            await asyncio.sleep(ANNOUNCE_RETRY_S)  # (a tier that failed an event now is seldom back at once)
            if self.tier.state in ("disabled", "stopped"):
                return
            if not self.tier.taking_pushes:
                continue
            names, self._unsaid = self._unsaid, set()
            self._reset -= names  # each one's next event is a reset again (a stored event meanwhile waits for it)
            await self._announce(self._held_keys(names))

    async def _reset_first(self, namespace: str) -> bool:
        """Whether this run's ``reset`` event of ``namespace`` is on its stream: sent now if not (one at a time per
        namespace, one try). Every ``stored`` event of this run goes after it, so a router drops what the stream
        said this host held before (a disk wiped, files removed or quarantined while it was down, an eviction whose
        event was lost in a crash) and keeps what it says from then on. Found in review: a start announced what its
        scan found, never what the host no longer held, and routers sent it prompts it could only miss. A server
        that refuses the event (an ACL without it) lets the stored events go as before, without one."""
        if namespace in self._reset:
            return True
        lock = self._resetting.setdefault(namespace, asyncio.Lock())
        async with lock:
            if namespace not in self._reset:
                why: list[Reason] = []
                if (
                    await self.tier.publish_event(EventKind.RESET, namespace, [], self.host, why)
                    or Reason.REFUSED in why
                ):
                    self._reset.add(namespace)
                    self._resetting.pop(namespace, None)  # (a caller waiting on the lock finds it sent)
        return namespace in self._reset

    def _looked_up(self, namespace: str) -> None:
        """A lookup of ``namespace`` asked the shared tier: its reset goes now, in the background, if this run has
        sent none (a host whose disk was wiped holds nothing its scan could announce, and a router that still
        lists it sends it that namespace's prompts; the first of them withdraws the claims). None past
        ``RESET_NAMESPACES_MAX`` namespaces remembered, nor while one of the namespace is being sent, nor while the
        breaker is not closed (never the half-open trial a lookup's own reads would take: a later lookup sends it)."""
        if namespace in self._reset or not _shared(namespace) or self.tier.state != State.CLOSED.value:
            return
        lock = self._resetting.get(namespace)
        if lock is not None and lock.locked():  # being sent
            return
        if lock is None and len(self._reset) + len(self._resetting) >= RESET_NAMESPACES_MAX:
            return
        self._spawn(self._reset_first(namespace), self._pushing)

    def _held(self, key: bytes) -> bool:
        rec = self.store.index.blocks.get(key)
        return rec is not None and rec.named

    def reclaimed(self, block: Block) -> None:
        """A store listener: say on the namespace's stream that this host no longer holds ``block`` (batched:
        one event per namespace for the blocks an eviction reclaims at once). Not a checkpoint's (``_shared``)."""
        if not _shared(block.namespace):
            return
        if not self._gone:
            asyncio.get_running_loop().call_soon(self._publish_gone)
        self._gone.setdefault(block.namespace, []).append(block.key)

    def _publish_gone(self) -> None:
        gone, self._gone = self._gone, {}
        for ns, keys in gone.items():
            self._spawn(self._said_gone(ns, keys), self._pushing)

    async def drain(self, timeout_s: float) -> bool:
        """Wait for the pushes being read and queued, then for the tier's queue, ``timeout_s`` in all: False if
        either was not done by then."""
        end = time.monotonic() + timeout_s
        if work := self._pushing | self._evicting:
            _, left = await asyncio.wait(list(work), timeout=timeout_s)
            if left:
                return False
        return await self.tier.drain(max(0.0, end - time.monotonic()))

    # --- fill ---------------------------------------------------------------------------------------------

    async def fill(
        self, ident: fmt.Identity, namespace: str, tokens: Sequence[int] | np.ndarray, provider: str
    ) -> bool:
        """Fetch into the store the longest prefix of ``tokens`` the remote tier has beyond the local one: True
        if a manifest was kept (a lookup then finds it). Never raises for a remote or a content failure. At most
        ``FILLS_AT_ONCE`` fetch at once (a lookup that finds none free misses at once); a lookup of a prompt whose
        fill is under way waits for that one."""
        if not isinstance(tokens, np.ndarray):  # held as 4 bytes a token while the fill waits on the remote tier
            tokens = token_array(fmt.encode_tokens(list(tokens)))  # (a list: 36; found in review, 38 MiB a lookup)
        digest = hashlib.sha256(blocks.token_bytes(tokens)).digest()
        sig = (identity_fingerprint(ident), namespace, provider, digest)
        if (task := self._filling.get(sig)) is not None:
            self.fills_shared += 1
        else:
            with one_failure():  # its calls (in its task and the tasks it starts) count one failure at most
                task = asyncio.ensure_future(self._fill(ident, namespace, tokens, provider))
                self._looked_up(namespace)  # (a reset it sends is of the same work)
            self._filling[sig] = task
            task.add_done_callback(lambda _: self._filling.pop(sig, None))
        try:
            return await asyncio.shield(task)  # a lookup that goes does not stop the others' fill
        except asyncio.CancelledError:
            if (me := asyncio.current_task()) is not None and me.cancelling():
                raise  # this lookup is cancelled
            return False  # the fill was (the link closing): a miss for everyone waiting on it

    async def _fill(self, ident: fmt.Identity, namespace: str, tokens: np.ndarray, provider: str) -> bool:
        size = self.store.block_tokens
        count = (len(tokens) - 1) // size if size else 0  # one token is always left to compute
        if count == 0:
            return False
        space = root_space(identity_fingerprint(ident), namespace, provider, size)
        root = await self._root(namespace, space)
        if isinstance(root, Reason):
            return self._missed("no_root") if root is Reason.ABSENT else self._unread(root)
        keys = await off_loop(lambda: blocks.chain(root, tokens, size, count))
        local = self.store.leading_blocks(keys)
        if local == count:
            return False
        failed: list[Reason] = []
        found = await self.tier.probe_chain(namespace, keys, start=local, why=failed)  # what we hold is not asked
        if found <= local:
            return self._unread(failed[0]) if failed else self._missed("no_longer_chain")
        asked = keys[found - 1]
        if (under_way := self._adopting.get(asked)) is not None:  # another prompt's fill takes this prefix now
            self.fills_shared += 1
            await asyncio.wait([under_way])
            return self.store.leading_blocks(keys) >= found
        # a fill is optional work, as a droppable spill is: the day's write budget and the write gate shed it alike
        # (found in review: a fill wrote whatever they said, every block of a one-off prompt another host held)
        if self.store.budget_spent():
            return self._missed("write_budget")
        if not self.store.admits_fill(ident, namespace, tokens, local):
            return self._missed("not_admitted")
        if self._fetching >= FILLS_AT_ONCE:  # every slot fetching: a miss now beats a lookup held behind them
            return self._missed("busy")
        self._fetching += 1  # taken here, in the turn that checked it: two lookups cannot both take the last one
        task = asyncio.ensure_future(self._fetch_and_adopt(ident, namespace, asked))
        self._adopting[asked] = task

        def done(_: object) -> None:
            self._fetching -= 1
            self._adopting.pop(asked, None)

        task.add_done_callback(done)
        return await task

    async def _fetch_and_adopt(self, ident: fmt.Identity, namespace: str, asked: bytes) -> bool:
        try:
            got = await self._manifest_for(namespace, asked)
        except _Refused as kept:
            return self._missed(kept.why)
        if isinstance(got, Reason):
            return self._missed("no_manifest") if got is Reason.ABSENT else self._unread(got)
        return await self._adopt(ident, namespace, *got, asked)

    def _unread(self, reason: Reason) -> bool:
        return self._missed(UNREAD.get(reason, UNREAD[Reason.DOWN]))

    def refusal(self, namespace: str, key: bytes) -> str | None:
        """Why the manifest under ``key`` was fetched and refused, if that was less than ``REFUSED_KEPT_S`` ago, and
        for ``too_many_blocks`` if this host still lacks the first block it lacked then. The blocks of a chain a
        host holds are a leading run (each entry names its chain from block 0), so a host that gained any of the
        manifest's blocks holds that one: found in review, a host that filled a shorter prefix of the conversation,
        so that the rest now fit a fill, still missed at once until ``REFUSED_KEPT_S`` passed."""
        got = self._refused.get((namespace, key))
        if got is None:
            return None
        when, why, lacked = got
        if self._clock() - when >= REFUSED_KEPT_S or (lacked is not None and self.store.has_block(lacked)):
            del self._refused[(namespace, key)]
            return None
        return why

    def _refuse(self, namespace: str, key: bytes, why: str, lacked: bytes | None = None) -> bool:
        """A miss, by ``why``, of the manifest under ``key``, which stays on the tier: remembered (``refusal``;
        ``lacked``: the first of its blocks this host lacks, for a refusal that depends on what it holds)."""
        self._refused.pop((namespace, key), None)
        self._refused[(namespace, key)] = (self._clock(), why, lacked)
        while len(self._refused) > REFUSED_KEPT_KEYS:
            self._refused.popitem(last=False)
        return self._missed(why)

    async def _root(self, namespace: str, space: bytes) -> bytes | Reason:
        """The root key of a layout, from our own pushes or fetched (a fetched one is read again after
        ``ROOT_KEPT_S``: a wrong one that someone put right is not kept until a restart); else why there is none
        (``ABSENT``: none on the tier)."""
        fetched = self._root_read.get(space)
        if space in self._roots and (fetched is None or time.monotonic() - fetched < ROOT_KEPT_S):
            return self._roots[space][0]
        why: list[Reason | None] = []
        # (never read whole; a few bytes, bounded as a probe: a hung server costs the lookup 50 ms, not 2 s)
        (raw,) = await self.tier.fetch(
            namespace, [space], Kind.ROOT, MAX_ROOT_VALUE_BYTES, why=why, timeout_s=self._small_s
        )  # fmt: skip
        if raw is None:
            return next((r for r in why if r is not None), Reason.ABSENT)
        try:
            root, whole = unpack(raw)
        except (ValueError, TypeError, msgpack.UnpackException):
            root = None
        if not isinstance(root, bytes) or len(root) != BLOCK_KEY_BYTES:  # a value, but not a root: never a hit
            self.tier.bad_value(namespace, space, Kind.ROOT)
            return Reason.BAD_BYTES
        self._roots[space] = (root, bool(whole))
        self._root_read[space] = time.monotonic()
        return root

    @property
    def _small_s(self) -> float:
        """The bound of a read of a small value on a lookup's path (a root, a reference): one round trip, as a
        probe's (found in review: read with a fetch's 2 s, a hung server held each lookup of a host without the
        root 2 s, until the breaker opened)."""
        return self.tier.config.probe_timeout_s

    async def _manifest_for(self, namespace: str, key: bytes) -> tuple[bytes, bytes] | Reason:
        """The manifest that ends at block ``key``, else the one its reference names (which names ``key`` too),
        with the key it is stored under; else why there is none (``ABSENT``: none there; else the first read that
        failed). ``_Refused`` for a manifest refused lately, not read again."""
        why: list[Reason | None] = []
        failed: list[Reason] = []

        async def read(k: bytes, kind: Kind, most: int, timeout_s: float | None = None) -> bytes | None:
            if kind is Kind.MANIFEST and (refused := self.refusal(namespace, k)) is not None:
                raise _Refused(refused)
            (v,) = await self.tier.fetch(namespace, [k], kind, most, why=why, timeout_s=timeout_s)
            failed.extend(r for r in why if r not in (None, Reason.ABSENT))  # (none when it read a value)
            return v

        if (m := await read(key, Kind.MANIFEST, MAX_MANIFEST_VALUE_BYTES)) is not None:
            return m, key
        ref = await read(key, Kind.REF, BLOCK_KEY_BYTES, self._small_s)
        if ref is not None and len(ref) != BLOCK_KEY_BYTES:
            self.tier.bad_value(namespace, key, Kind.REF)
            failed.append(Reason.BAD_BYTES)
        elif ref is not None and (m := await read(ref, Kind.MANIFEST, MAX_MANIFEST_VALUE_BYTES)) is not None:
            return m, ref
        return failed[0] if failed else Reason.ABSENT  # (a reference to a manifest gone heals with the next push)

    async def _adopt(self, ident: fmt.Identity, namespace: str, manifest: bytes, under: bytes, asked: bytes) -> bool:
        """Keep the manifest fetched for block ``asked`` (stored under key ``under``: ``asked``, or the one the
        block's reference names) and the blocks it names that this host lacks. A value found bad is removed."""
        try:  # a header and a key chain of up to 64 MiB: checked off the loop
            keys, bound = await off_loop(functools.partial(_named_blocks, manifest), compute=True)
        except errors.SpillError as exc:
            left = isinstance(exc, NEWER_WRITER)  # (a newer writer's: left on the tier, remembered)
            self.tier.bad_value(namespace, under, Kind.MANIFEST, remove=not left)
            return self._refuse(namespace, under, "bad_bytes") if left else self._missed("bad_bytes")
        if asked not in keys:  # another prompt's manifest put under this key: nothing of it serves this one
            if under == asked:
                self.tier.bad_value(namespace, under, Kind.MANIFEST)
            else:  # the block's reference names a manifest that does not name the block
                self.tier.bad_value(namespace, asked, Kind.REF)
            return self._missed("wrong_manifest")
        want = _lacking(keys, self.store.has_block, MAX_FILL_BLOCKS)
        if want is None:
            lacked = next(k for k in keys if not self.store.has_block(k))  # (one there is: more than the bound)
            return self._refuse(namespace, under, "too_many_blocks", lacked)
        if bound > MAX_FILL_BLOCK_BYTES:
            return self._refuse(namespace, under, "block_too_large")
        newer: list[bytes | None] = []  # files of a newer writer: refused here, left on the tier

        def bad(key: bytes | None, exc: errors.FileFormatError) -> None:  # a fetched file, bad in itself
            remove = not isinstance(exc, NEWER_WRITER)
            if not remove:
                newer.append(key)
            self.tier.bad_value(
                namespace, under if key is None else key, Kind.MANIFEST if key is None else Kind.BLOCK, remove=remove
            )

        try:
            async with contextlib.aclosing(self._fetched(namespace, want, bound)) as batches:
                await self.store.adopt(ident, namespace, manifest, batches, on_bad=bad)
        except _Absent as gone:  # counted by why (found in review: a read that timed out said "absent")
            return self._missed(UNFETCHED.get(gone.reason, UNFETCHED[Reason.DOWN]))
        except errors.BlockMissing:  # a block held here went meanwhile (evicted): nothing of the remote's is wrong
            return self._missed("local_block_gone")
        except errors.FileFormatError as exc:  # (files that disagree, or one held here: nothing is removed)
            log.warning("refused a manifest or block from the remote tier: %s", exc)
            return self._refuse(namespace, under, "bad_bytes") if newer else self._missed("bad_bytes")
        except errors.SpillError as exc:
            log.warning("could not keep what the remote tier sent: %s", exc)
            return self._missed("store_error")
        self.fills += 1
        return True

    async def _fetched(self, namespace: str, want: list[bytes], bound: int) -> AsyncGenerator[dict[bytes, bytes], None]:
        """``want``'s values in batches of ``FILL_BATCH_KEYS`` (fewer, of ``bound`` bytes each, past
        ``FILL_BATCH_BYTES``), the next batch fetched while the store checks and
        writes this one (at most two batches in memory); ``_Absent`` once one could not be fetched."""
        per = max(1, min(FILL_BATCH_KEYS, FILL_BATCH_BYTES // max(bound, 1)))
        parts = [want[lo : lo + per] for lo in range(0, len(want), per)]

        def fetch(part: list[bytes]) -> asyncio.Future[tuple[list[bytes | None], list[Reason | None]]]:
            async def run() -> tuple[list[bytes | None], list[Reason | None]]:
                why: list[Reason | None] = []
                return await self.tier.fetch(namespace, part, Kind.BLOCK, bound, why=why), why

            return asyncio.ensure_future(run())

        ahead = fetch(parts[0]) if parts else None
        try:
            for i, part in enumerate(parts):
                assert ahead is not None
                got, why = await ahead
                ahead = fetch(parts[i + 1]) if i + 1 < len(parts) else None
                if (reason := next((w for w in why if w is not None), None)) is not None:
                    raise _Absent(reason)
                yield dict(zip(part, [v for v in got if v is not None], strict=True))
        finally:
            if ahead is not None:  # the store gave up on this fill: the fetch is not wanted (it never raises)
                ahead.cancel()

    def _missed(self, why: str) -> bool:
        self.fill_misses[why] += 1
        return False

    async def close(self, timeout_s: float) -> bool:
        """Push what is queued within ``timeout_s``, then stop the tier; whether every push went."""
        pushed = await self.drain(timeout_s)
        tasks = [*self._pushing, *self._evicting, *self._filling.values()]
        tasks += [t for t in (self._announcing, self._saying_again) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(
            *tasks, return_exceptions=True
        )  # their cleanups (kept files let go) run before the tier goes
        await self.tier.close()
        if (late := self._saying_again) is not None and not late.done():  # (an event failed as they ended)
            late.cancel()
            await asyncio.gather(late, return_exceptions=True)
        return pushed

    def counters(self) -> dict[str, Any]:
        return self.tier.counters() | {
            "push": self.push,
            "host": self.host,
            "fills": self.fills,
            "fill_misses": dict(self.fill_misses),
            "pushing": len(self._pushing) + len(self._evicting),
            "evicted_skipped": self.evicted_skipped,
            "pushes_too_large": self.pushes_too_large,
            "pushes_skipped": self._turns.skipped,
            "fills_shared": self.fills_shared,
        }


def _lacking(keys: list[bytes], held: Callable[[bytes], bool], most: int) -> list[bytes] | None:
    """The keys not ``held``, each once, in order; None as soon as there are more than ``most`` (on the loop: a
    hostile manifest of 500,000 keys is given up on after ``most`` of them, not walked whole)."""
    want: dict[bytes, None] = {}
    for k in keys:
        if k not in want and not held(k):
            want[k] = None
            if len(want) > most:
                return None
    return list(want)


def _named_blocks(manifest: bytes) -> tuple[list[bytes], int]:
    """The block keys a fetched manifest names (its header checked first), and the most bytes one of its blocks
    may hold: block 0's file as this build plans it, plus slack for the header fields that vary and for a page of
    padding a tensor (a block another version wrote may align small tensors to pages)."""
    header = header_from_bytes(manifest, len(manifest))
    if header.blocks is None:
        raise errors.BlockInvalid("a fetched manifest names no blocks")
    planned = Expected(header)
    head = fmt.PREFIX_LEN + len(fmt.pack_header(planned.tpl)) + BLOCK_HEADER_SLACK
    padding = planned.tensors * fmt.ALIGN
    return list(header.blocks.keys), fmt.align_up(head, fmt.ALIGN) + planned.end + padding


async def open_link(cfg: Config, store: Store) -> RemoteLink:
    """The daemon's remote tier (``--remote``), started: a server that cannot be reached, or refuses the
    password, leaves it missing (logged), never the daemon down. ``RemoteConfigError`` for settings that
    cannot work (a password in the URL, a key file open to others)."""
    tier = RemoteTier(remote_config(cfg))
    await tier.start()
    link = RemoteLink(tier, store, cfg.remote_push, cfg.remote_host_name)
    link.announce_held()  # what a restart kept (in the background: serving starts now)
    return link


def remote_config(cfg: Config) -> RemoteConfig:
    """The tier's settings from the daemon's (``--remote*``)."""
    return RemoteConfig(
        cfg.remote or "", cluster=cfg.remote_cluster, ttl_s=cfg.remote_ttl,
        password_file=cfg.remote_password_file, key_file=cfg.remote_key_file,
    )  # fmt: skip


def check_remote(cfg: Config) -> None:
    """Raise ``RemoteConfigError`` now for settings that cannot work (the URL, the password and key files),
    before the daemon starts; nothing is connected."""
    RemoteTier(remote_config(cfg))
