"""The cold tier on disk. Files are the database.

Layout: ``<root>/<identity fingerprint>/<namespace hash>/<id>.spilld``, temp
files beside them. Folder names are hex digests we compute, never caller
strings, so no namespace or key can name a path outside the root. A scan at
start-up rebuilds the index from the headers of every fingerprint under the
root and reaps temp orphans. Lookups match the caller's fingerprint.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import math
import os
import secrets
import shutil
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import assemble, blocks, errors, fileio, validate
from .. import format as fmt
from ..admission import Admission
from ..blocks import BLOCK_EXT, DEFAULT_BLOCK_TOKENS, Split
from ..codecs import MLX_LM_PROVIDER_ID, CodecProvider, default_provider
from ..config import DEFAULT_IO_TIMEOUT_S, check_block_tokens
from ..entries import (
    Block,
    Entry,
    Hit,
    Miss,
    MissReason,
    StoreCounters,
    StoreListener,
    Wear,
    checkpoint_namespace,
    identity_fingerprint,
    namespace_hash,
)
from ..lease import RunStep, off_loop, within
from ..loader import Loaded, load, read_header
from ..lockfile import LOCK_NAME, FileLock
from ..matching import Found, Query, common_prefix, start_key
from ..queue import unpin
from ..saver import WRITE_BATCH_BYTES, AnySource, Attachment, SaveResult, Staging, plan, save_async, take_all
from ..validate import validate_header
from .eviction import evict_order, protected
from .folders import FolderClaims, remove_empty_folders
from .index import Index, ns_dir
from .listing import EXT
from .pins import read_pins, update_pins
from .quarantine import QUARANTINE_MAX_BYTES, move_aside
from .scan import Scanned, ScanTally, scan_root
from .unlinks import Unlinks, unlink_all
from .wearfile import add_wear, read_wear

log = logging.getLogger("spilld.store")
T = TypeVar("T")
Tokens = Sequence[int] | np.ndarray  # a prompt: ints, or a lookup's uint32 array (entries.token_array)

EVICTED_MEMORY = 256  # evicted entries remembered per namespace, to explain misses
DEFAULT_DISK_CAP = 64 * 1024**3
EVICT_BATCH = 256  # entries an evict request takes out of the index per turn of the event loop
STORE_ERROR_RUN_LOG = 100  # in a run of failed writes, one summary line every this many
FOLDER_WAIT_S = 0.005  # how often a save polls while the sweep removes the folder it is about to write in
LOOKUP_ATTEMPTS = 3  # comparisons a lookup makes when the entry it found was removed while it compared


def default_disk_cap(root: str, own: int = 0) -> int:
    """The smaller of 64 GiB and a quarter of the space the store may have: the free space at start and the ``own``
    bytes it holds already (found in review: counting free space alone shrank the cap of a full store at each
    restart, and the scan then evicted a fifth of it)."""
    os.makedirs(root, exist_ok=True)
    return min(DEFAULT_DISK_CAP, (shutil.disk_usage(root).free + own) // 4)


def _set_mtime(path: str, when: float) -> None:
    with contextlib.suppress(OSError):  # a link put in an entry's place: its target is not ours (found in review)
        os.utime(path, (when, when), follow_symlinks=False)


class Store:
    """Index, lookup, supersede, LRU eviction and quarantine over one root folder."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        disk_cap: int | None = None,
        durability: fileio.Durability | str = fileio.Durability.FSYNC,
        provider: CodecProvider | None = None,
        verify: bool = True,
        ops: fileio.FileOps = fileio.DEFAULT_OPS,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        write_budget: int | None = None,
        namespace_quota: int | None = None,
        pin_cap: int | None = None,
        admit_after: int = 0,
        io_timeout: float | None = DEFAULT_IO_TIMEOUT_S,
    ) -> None:
        # B of the blocks new spills are cut into (0: whole files, format v1 style)
        self.block_tokens = check_block_tokens(block_tokens)
        self.write_budget = write_budget  # bytes a day; once written, droppable spills are shed (None: no budget)
        self.wear = Wear()
        self.io_timeout = io_timeout  # seconds a write step, a restore's read or an unlink may take (None: forever)
        # the write gate: counts of lookups per prefix (None: every spill is written)
        self.admission = Admission(admit_after, block_tokens or DEFAULT_BLOCK_TOKENS) if admit_after else None
        self.namespace_quota = namespace_quota  # bytes on disk one namespace may hold (None: only the disk cap)
        self.root = os.path.abspath(os.fspath(root))
        self.durability = fileio.Durability(durability)
        self.ops = ops  # the file layer of every save and removal (tests swap in one that injects faults)
        fileio.make_dirs(self.ops, self.root, self.durability)
        self.disk_cap = default_disk_cap(self.root) if disk_cap is None else disk_cap
        self._default_cap = disk_cap is None  # computed again once a scan knows the store's own bytes
        self._unlink_refused: set[str] = set()  # files an unlink refused last time (said once)
        self.scan_tally = ScanTally()  # the files the last scan has looked at so far
        self.pin_cap = self.disk_cap // 4 if pin_cap is None else pin_cap  # pinned bytes evicted last, at most this
        self._default_pin_cap = pin_cap is None  # a quarter of the disk cap, whenever that is computed again
        self._pins: set[str] = set()  # paths of pinned entries (kept in the pins file: pins.py)
        # pins the file names that the index lacks (another writer's, or skipped by the scan): never judged here
        self._unjudged: set[str] = set()
        self._pin_changes: dict[str, bool] = {}  # this process's pins and unpins the file does not have yet
        self._pins_written = asyncio.Lock()  # one pins file written at a time, each with the changes as they are then
        self._pins_file = threading.Lock()  # ... and one thread in it, a late one included
        self._provider = provider  # built on first use: the daemon only moves bytes and never needs codecs
        self.verify = verify
        self.counters = StoreCounters()
        self._evicted: dict[tuple[str, str], deque[np.ndarray]] = {}
        self.index = Index()  # changed only on the thread that owns the store (the event loop), read anywhere
        self._doomed = Unlinks()  # files whose entries left the index, still to unlink (off the loop)
        self._durable_folders: set[str] = set()  # entry folders whose names this process made durable
        # folders a save writes into: never removed as empty; one removed is durable no more (made again, its name
        # must be synced again before a save there is reported stored)
        self._folders = FolderClaims(on_removed=self._durable_folders.discard)
        self._error_run = 0  # writes failed in a row
        self.quarantine_cap = QUARANTINE_MAX_BYTES
        self.lock = FileLock(os.path.join(self.root, LOCK_NAME), f"the folder {self.root}")
        self.listeners: list[StoreListener] = []  # told of each entry stored with blocks (the remote tier's push)

    @property
    def provider(self) -> CodecProvider:
        """The codecs this store loads with (mlx-lm's unless one was given; importing them needs mlx-lm)."""
        if self._provider is None:
            self._provider = default_provider()
        return self._provider

    @property
    def provider_id(self) -> str:
        """The codec provider whose files a lookup may return by default (known without building it)."""
        return self._provider.id if self._provider is not None else MLX_LM_PROVIDER_ID

    @property
    def entries(self) -> list[Entry]:
        """Every indexed entry, oldest indexed first (a copy)."""
        return list(self.index.by_path.values())

    @property
    def count(self) -> int:
        return len(self.index.by_path)

    def acquire(self) -> None:
        """Become the folder's one owner for this process's life (``AlreadyRunning`` if another spilld is)."""
        self.lock.acquire()

    def close(self) -> None:
        self.lock.release()

    async def record_wear(self) -> None:
        """Add what this run wrote to the wear file, so that a later run's write budget counts it: at a stop, before
        the lock goes. On a worker thread within the I/O deadline (found in review: done on the loop, a hung disk held
        a stop for good); a failure is said, and that count is lost."""
        written, self.wear.written = self.wear.written, {}
        if not written:
            return
        try:
            await self._io(
                lambda: add_wear(self.root, written, self.wear.hour(), self.ops, self.durability), "the wear file"
            )
        except (OSError, errors.SpillError) as exc:  # a full disk, a link at its name, a hung disk
            log.warning("%s: the bytes written this run were not recorded: %s", self.root, exc)

    # --- paths ---------------------------------------------------------------------

    def folder(self, ident: fmt.Identity, namespace: str) -> str:
        return os.path.join(self.root, identity_fingerprint(ident), namespace_hash(namespace))

    def new_path(self, ident: fmt.Identity, namespace: str) -> str:
        """A fresh file name in the entry's folder (nothing is created: see ``make_folder``)."""
        return os.path.join(self.folder(ident, namespace), secrets.token_hex(12) + EXT)

    def claim_folder(self, folder: str) -> None:
        """Mark a folder as written into: the empty-folder sweep leaves it (and its parent) alone until released."""
        self._folders.claim(folder)

    def release_folder(self, folder: str) -> None:
        self._folders.release(folder)

    def _sync_folder_path(self, folder: str, created: Sequence[str] = ()) -> None:
        """Make an entry folder's name and its model folder's durable, once a process (blocking: a worker thread),
        and those of the ``created`` folders above them (the root, made again after it was removed: found in review,
        its parent was never synced). A folder found made is synced too: an earlier attempt may have made it and
        failed before its fsync, or another put made it and has not synced it yet."""
        fileio.sync_folders(self.ops, [*created, os.path.dirname(folder), folder], self.durability)
        self._durable_folders.add(folder)

    @property
    def total_bytes(self) -> int:
        """Bytes on disk, each block once (what the disk cap counts)."""
        return self.index.total_bytes

    @property
    def blocks(self) -> list[Block]:
        return list(self.index.blocks.values())

    def block_path(self, key: bytes) -> str | None:
        rec = self.index.blocks.get(key)
        return rec.path if rec is not None else None

    def named_blocks(self, e: Entry) -> list[Block]:
        """The blocks ``e`` names that this store indexes, in chain order."""
        return [rec for k in e.blocks if (rec := self.index.blocks.get(k)) is not None]

    def block_bytes(self, key: bytes) -> int:
        rec = self.index.blocks.get(key)
        return rec.nbytes if rec is not None else 0

    # --- scan ----------------------------------------------------------------------

    def scan(self, stopped: Callable[[], bool] = bool) -> int:
        """Rebuild the index from the files under the root. When no other spilld owns the folder (its lock is ours
        or free), also reap temp orphans, quarantine bad files and evict to the cap; else the files are the owner's
        and nothing is removed or moved. Once ``stopped()`` says so the scan ends where it is, its index not
        taken (a daemon told to stop while it scans: found in review, the stop waited for the whole scan)."""
        held = self.lock.held
        reap = held or self._try_lock()
        took = reap and not held
        try:  # a lock taken for the scan is held until its last removal: another spilld may take it at once after
            self.scan_tally = ScanTally()
            found = scan_root(self.root, self.ops, reap, stopped, self.scan_tally)
            if found.stopped:
                log.info("%s: scan stopped before its end", self.root)
                return self.count
            self._take_scan(found, reap)
            self.wear.recorded(read_wear(self.root, self.wear.hour()))
            if self._default_cap:
                self.disk_cap = default_disk_cap(self.root, self.total_bytes)
            if self._default_pin_cap:  # (found in review: a quarter of the cap before the scan, not of this one)
                self.pin_cap = self.disk_cap // 4
            named = set(read_pins(self.root))
            self._pins = {p for p in named if p in self.index.by_path}
            self._unjudged = named - self._pins
            log.info("%s: %d entries, %d bytes, cap %d bytes", self.root, self.count, self.total_bytes, self.disk_cap)
            if reap:  # another owner's files are never evicted to this store's cap
                before = self.total_bytes
                if n := self.evict_to_cap():  # said: a --disk-cap lowered (or mistyped) empties a store at start
                    log.warning(
                        "%s: evicted %d entries (%d bytes) to fit the disk cap of %d bytes",
                        self.root, n, before - self.total_bytes, self.disk_cap,
                    )  # fmt: skip
                self._delete_doomed()
        finally:
            if took:
                self.lock.release()
        return self.count

    def _try_lock(self) -> bool:
        try:
            return self.lock.try_acquire()
        except errors.StorageError:  # a folder we may only read: nothing is reaped
            return False

    def _take_scan(self, found: Scanned, reap: bool) -> None:
        """The scan's index becomes the store's; its bad files are moved aside, its orphan blocks removed."""
        self.index = found.index
        self.counters.reaped_temp += found.reaped_temp
        for path, exc in found.bad:
            if reap:
                self.quarantine(path, exc)
            else:  # not indexed, left for the folder's owner to move aside
                log.warning("not indexed (another spilld owns %s): %s", self.root, exc)
        for b in found.orphans:  # written before a crash took their manifest, or left by evicted ones
            self._drop_block(b)
        if reap:
            self.counters.blocks_reclaimed += len(found.orphans)
        else:  # another spilld owns the folder: its blocks are not ours to remove
            self._doomed.forget_where(lambda p: p.endswith(BLOCK_EXT))

    def disown_files(self) -> None:
        """Every file indexed now is another writer's too (one may have scanned the folder alone): none is
        unlinked here, and no block reused; puts write blocks of their own."""
        for rec in self.index.blocks.values():
            rec.owned = False
        for e in self.index.by_path.values():
            e.owned = False

    def _add_block(self, key: bytes, path: str, nbytes: int) -> Block:
        """A block file just published (its folder not synced yet) into the index."""
        rec = self.index.blocks.get(key)
        if rec is not None and rec.owned:  # another put published the same block meanwhile: ours is a spare
            self._doomed.add(path)
            return rec
        # another writer's file of this block: ours takes its place here (theirs is left alone)
        new = self.index.add_block(key, path, nbytes) if rec is None else self.index.replace_block(rec, path, nbytes)
        new.synced = False
        return new

    def _drop_block(self, rec: Block) -> bool:
        """``rec`` out of the index (False: it was not the block indexed under its key), its file doomed if ours."""
        if not self.index.drop_block(rec):
            return False
        if rec.owned:  # another writer's file may be named by entries we never saw
            self._doomed.add(rec.path)
        return True

    def _reclaim_if_unused(self, rec: Block) -> None:
        """A block no manifest names and no put is about to name goes; listeners are told of one that a manifest
        named (announced as stored), never of one a failed put wrote, nor of one already out (found bad: told
        then, by ``_take_out_block``)."""
        if not rec.refs and not rec.pins and self._drop_block(rec):
            self.counters.blocks_reclaimed += 1
            self._told_gone(rec)

    def _told_gone(self, rec: Block) -> None:
        """Listeners are told ``rec`` left the store, if a manifest named it (only then was it announced stored)."""
        for listener in self.listeners if rec.named else []:
            listener.reclaimed(rec)

    # --- lookup ------------------------------------------------------------------------

    def lookup(
        self, ident: fmt.Identity, namespace: str, tokens: Tokens, *, codec_provider: str | None = None
    ) -> Hit | Miss:
        """The longest usable prefix of ``tokens`` (at most len - 1: one token must be computed).

        Only entries written by ``codec_provider`` (default: this store's) can be used. Only the entries
        of the namespace that start with the prompt's first token are compared (``lookup_async`` compares
        them on a worker thread).
        """
        q = self._query(ident, namespace, tokens, codec_provider)
        return self._settle(q, q.match())

    async def lookup_async(
        self,
        ident: fmt.Identity,
        namespace: str,
        tokens: Tokens,
        *,
        codec_provider: str | None = None,
        counted: bool = True,
        tally: bool = True,
    ) -> Hit | Miss:
        """``lookup`` with the token comparisons on a worker thread; the index is read on the loop only.
        ``counted`` False: the prompt was asked for already (a lookup again after a fill): the write gate does not
        count it twice (found in review). ``tally`` False: a miss is not counted in ``misses`` (the caller may look
        again, and counts the answer it keeps with ``tally_miss``)."""
        for _ in range(LOOKUP_ATTEMPTS):
            q = self._query(ident, namespace, tokens, codec_provider, counted)
            busy = q.by_start or q.heads is not None or q.evicted or q.roots or q.ask
            found = await off_loop(q.match, compute=True) if busy else Found()
            # Its best entry superseded while the comparison ran (the same prompt spilled again): compare again,
            # against the index as it is now, rather than miss an entry that is still there under a new name.
            if found.best is None or found.best.entry.path in self.index.by_path:
                break
        return self._settle(q, found, tally)

    def _query(
        self, ident: fmt.Identity, namespace: str, tokens: Tokens, provider: str | None, counted: bool = True
    ) -> Query:
        want = np.asarray(tokens, dtype=np.uint32)
        fp = identity_fingerprint(ident)
        gate = self.admission
        ask = (self._ask_scope(ident, namespace), gate.size) if gate is not None and counted else None
        prov = provider or self.provider_id
        group = self.index.by_start.get(start_key(namespace, want), {}) if len(want) > 1 else {}
        roots = [(r, size, whole) for r, (size, whole) in self.index.roots.get((fp, namespace, prov), {}).items()]
        evicted = list(self._evicted.get((fp, namespace), ()))
        heads = self.index.heads.get((fp, namespace, prov)) if len(want) > 1 else None
        return Query(
            want, fp, prov, group, evicted, roots if len(want) > 1 else [], self.index.blocks, self.index.by_path,
            self.index.by_last, ask, heads,
        )  # fmt: skip

    def _settle(self, q: Query, found: Found, tally: bool = True) -> Hit | Miss:
        if self.admission is not None:  # the prompt's asks, hashed with the comparisons (off the loop, async)
            self.admission.count(found.asked)
        if found.best is not None:
            if found.best.entry.path in self.index.by_path:
                return found.best
            reason = MissReason.EVICTED  # removed while the comparison ran
        elif found.untrimmable:
            reason = MissReason.UNTRIMMABLE
        elif found.codec:
            reason = MissReason.CODEC_MISMATCH
        elif found.foreign:
            reason = MissReason.IDENTITY_MISMATCH
        elif found.evicted:
            reason = MissReason.EVICTED
        else:
            reason = MissReason.NO_ENTRY
        return self._miss(reason) if tally else Miss(reason)

    def _miss(self, reason: MissReason) -> Miss:
        self.counters.misses[reason.value] += 1
        return Miss(reason)

    def tally_miss(self, miss: Miss) -> None:
        """Count a miss a lookup made with ``tally`` False, once its caller keeps it as the answer."""
        self.counters.misses[miss.reason.value] += 1

    def restore(self, hit: Hit, ident: fmt.Identity) -> Loaded | Miss:
        """Load a hit, cut back to its matched length; a file that fails is quarantined (a miss)."""
        try:
            loaded = self.read_hit(hit, ident)
        except errors.SpillError as exc:
            return self.restore_done(hit, exc)
        return self.restore_done(hit, loaded)

    def read_hit(self, hit: Hit, ident: fmt.Identity) -> Loaded:
        """The file read alone: touches no index state, so it may run on a worker thread."""
        e = hit.entry
        return load(
            e.path, expect=ident, verify=self.verify, upto=hit.matched, provider=self.provider,
            blocks=self.block_path, blocks_only=hit.blocks_only, ops=fileio.OWN_OPS,
        )  # fmt: skip

    def restore_done(self, hit: Hit, outcome: Loaded | errors.SpillError) -> Loaded | Miss:
        """Account for a read (on the index's own thread): a hit, or a miss with its reason."""
        e = hit.entry
        if isinstance(outcome, Loaded):
            self.touch(e)
            self.counters.hits += 1
            return outcome
        if isinstance(outcome, errors.FileFormatError):
            self.quarantine(self._bad_file(e, outcome), outcome)
            return self._miss(MissReason.CORRUPT)
        where = self._read_path(e, outcome)
        return self._failed_read(e, outcome, isinstance(outcome, errors.StorageError) and fileio.known_absent(where))

    async def bad_read_async(self, e: Entry, exc: errors.FileFormatError) -> None:
        """A read of ``e`` found a bad file (``exc.path``: the entry's own, or one of its blocks): it is moved
        aside, and a bad block takes every entry naming it out of the index."""
        await self.quarantine_async(self._bad_file(e, exc), exc)
        await self.delete_doomed_async()

    def _bad_file(self, e: Entry, exc: errors.FileFormatError) -> str:
        """The file a failed read blames: a bad block takes every manifest that names it out of the index."""
        rec = self.index.block_of(e, exc.path)
        if rec is None:
            return e.path
        self._take_out_block(rec)
        return rec.path

    def holds(self, path: str) -> bool:
        """``path`` is one of the store's files now: an entry's, or the block its name says."""
        return path in self.index.by_path or self._block_at(path) is not None

    def _block_at(self, path: str) -> Block | None:
        """The block indexed under the key ``path``'s name says, if ``path`` is its file."""
        key = blocks.key_of_name(os.path.basename(path))
        rec = self.index.blocks.get(key) if key is not None else None
        return rec if rec is not None and rec.path == path else None

    def _take_out_block(self, rec: Block) -> None:
        """A bad block out of the index, with every entry naming it (the file is the caller's to move aside);
        listeners are told it left, as of a block reclaimed, if a manifest named it (it was announced stored)."""
        # out first: it is moved aside, never unlinked with the manifests' own
        if self.index.drop_block(rec):  # found in review: routers were never told, and sent its prompts here
            self._told_gone(rec)
        self._remove_naming(rec)

    async def found_bad_async(self, path: str, exc: errors.FileFormatError) -> bool:
        """A file found bad outside a read (the scrub): moved aside; a bad block takes every entry naming it out
        of the index. False if the store no longer holds that file (evicted meanwhile)."""
        if (rec := self._block_at(path)) is not None:
            self._take_out_block(rec)
        elif path not in self.index.by_path:
            return False
        await self.quarantine_async(path, exc)
        await self.delete_doomed_async()
        return True

    async def lost_async(self, path: str) -> bool:
        """A stored file a read could not open, if it is known gone from the disk (removed by hand, or by a cleaner
        of old files under /var/tmp): out of the index, a block with every entry naming it, as a restore that finds
        it gone does. False if it may still be there (EIO, a hung disk), or is not the store's any more."""
        if not await self._known_gone(path):
            return False
        if (rec := self._block_at(path)) is not None:
            self._take_out_block(rec)
        elif (e := self.index.by_path.get(path)) is not None:
            self._forget(e)  # its file is not there to remove
        else:
            return False  # evicted or superseded meanwhile
        await self.delete_doomed_async()
        return True

    def _remove_naming(self, rec: Block) -> None:
        """Every entry that names ``rec`` out of the index (its block is bad or gone: none of them can be read)."""
        for p in list(rec.refs):
            if (other := self.index.by_path.get(p)) is not None:
                self._remove(other)

    async def restore_async(self, hit: Hit, ident: fmt.Identity) -> Loaded | Miss:
        """``restore`` on an event loop: the read, the mtime, the existence check and a quarantine's move run on
        worker threads; the index changes on the loop only."""
        try:
            outcome: Loaded | errors.SpillError = await self._io(lambda: self.read_hit(hit, ident), "a restore's read")
        except errors.StorageTimeout as exc:
            log.warning("restore of %s: %s", hit.entry.path, exc)
            return self._miss(MissReason.IO_TIMEOUT)
        except errors.SpillError as exc:
            outcome = exc
        e = hit.entry
        if isinstance(outcome, Loaded):
            await self.touch_async(e)
            self.counters.hits += 1
            return outcome
        if isinstance(outcome, errors.FileFormatError):
            if self.index.by_path.get(e.path) is not e:  # evicted (or found bad) while read: not its files' fault
                return self._miss(MissReason.EVICTED)
            await self.bad_read_async(e, outcome)
            return self._miss(MissReason.CORRUPT)
        gone = isinstance(outcome, errors.StorageError) and await self._known_gone(self._read_path(e, outcome))
        return self._failed_read(e, outcome, gone)

    async def _known_gone(self, path: str) -> bool:
        """Whether ``path`` is known gone from the disk, checked on a worker thread within the I/O deadline (a hung
        disk: not known gone)."""
        try:
            return await self._io(lambda: fileio.known_absent(path), "a check")
        except errors.StorageTimeout:
            return False

    def _read_path(self, e: Entry, exc: errors.SpillError) -> str:
        """The file a failed read of ``e`` was reading: one of its blocks, or the entry's own file."""
        rec = self.index.block_of(e, exc.path)
        return rec.path if rec is not None else e.path

    def _failed_read(self, e: Entry, outcome: errors.SpillError, gone: bool) -> Miss:
        rec = self.index.block_of(e, outcome.path)
        if gone and rec is not None:  # a block removed under us: every entry naming it is unusable
            log.warning("a block of %d entries is gone: %s", len(rec.refs), rec.path)
            self._take_out_block(rec)  # its record too: a put under way that reuses it must fail, not name it
            return self._miss(MissReason.CORRUPT)
        if gone:
            self._remember_evicted(e)  # evicted between lookup and open
            self._forget(e)
            return self._miss(MissReason.EVICTED)
        if isinstance(outcome, errors.StorageError):
            log.warning("could not read %s: %s", e.path, outcome)  # EMFILE, EIO...: a miss; the file stays
            return self._miss(MissReason.CORRUPT)
        # A valid file this reader must not use (codecs, identity): a miss, never quarantined.
        return self._miss(MissReason.IDENTITY_MISMATCH)

    def entry_at(self, path: str) -> Entry | None:
        return self.index.by_path.get(path)

    def touch(self, e: Entry) -> None:
        """A restore counts as use (kept across restarts through the file's mtime)."""
        e.last_used = time.time()
        _set_mtime(e.path, e.last_used)

    async def touch_async(self, e: Entry) -> None:
        """``touch`` with the file's mtime set on a worker thread."""
        e.last_used = when = time.time()
        with contextlib.suppress(errors.StorageTimeout):  # a hung disk: the use is counted, its mtime set later
            await self._io(lambda: _set_mtime(e.path, when), "an mtime")

    # --- store --------------------------------------------------------------------------

    async def put(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        ident: fmt.Identity,
        *,
        meta: dict[str, str] | None = None,
        attachments: Sequence[Attachment] = (),
        checkpoint: fmt.GenerationCheckpoint | None = None,
        run_step: RunStep | None = None,
        write_in_lease: bool = False,
        planned: tuple[fmt.Header, list[AnySource]] | None = None,
        staging: Staging | None = None,
        droppable: bool = False,
        pin: bool = False,
        held_rows: int = 0,
        batch_bytes: int = 0,
    ) -> SaveResult:
        """Write an entry durably, then index it, supersede what it replaces and evict to the cap.

        ``planned`` is a snapshot planned earlier with ``saver.plan(..., live=True)``. ``held_rows``: the rows of
        its positional caches its sources lack because the store held their blocks (``held_rows``, for the daemon's
        ingest); the put fails (``HeldBlockGone``) if one of those blocks went since. A ``droppable`` spill is
        shed (``WriteBudgetSpent``, a DROPPED outcome) once the day's write budget is spent. ``batch_bytes``: see
        ``saver.save_async`` (for sources that are plain bytes and a lease that keeps no engine waiting). Files are written
        through the store's file layer (``self.ops``); folders, writes and unlinks run off the event loop.
        """
        # a checkpoint is written whatever the budget, as a non-droppable spill is (found in review: once the
        # budget was spent every checkpoint was shed, and resume found none)
        ckpt = (planned[0].checkpoint if planned is not None else checkpoint) is not None
        if droppable and not ckpt and self.budget_spent():
            self.counters.dropped_budget += 1
            raise errors.WriteBudgetSpent(
                f"{self.wear.last_day()} bytes written in the last 24 h (budget {self.write_budget}): a droppable spill is shed"
            )
        if planned is None:
            planned = plan(
                tokens, caches, meta=meta, identity=ident, attachments=attachments, checkpoint=checkpoint,
                provider=self.provider,
            )  # fmt: skip
        ident = planned[0].identity
        if self.block_tokens and run_step is not None and not write_in_lease and not batch_bytes:
            # an engine's arrays: their bytes taken once each in its lease, then every block written in batches
            planned, batch_bytes = (planned[0], await take_all(planned[1], run_step)), WRITE_BATCH_BYTES
        cut = blocks.split(*planned, self.block_tokens) if self.block_tokens else None
        held = self._check_held(cut, held_rows)
        # a checkpoint is never asked for by a lookup (resume finds it): the gate would shed every one (review)
        if droppable and not ckpt and self.admission is not None:
            self._admit(planned[0], held)
        logical = planned[0].data_bytes
        path = self.new_path(ident, ident.namespace)
        folder = os.path.dirname(path)
        kw: dict[str, Any] = {
            "run_step": run_step, "write_in_lease": write_in_lease, "staging": staging, "batch_bytes": batch_bytes
        }  # fmt: skip
        pinned: list[Block] = []
        written: list[Block] = []
        self.claim_folder(folder)  # from here to the rename, no sweep removes the folder under the write
        try:
            await self._make_folder(folder, room=True)  # once: the blocks and the entry share it
            self._check_held(cut, held_rows)  # again: room made for the folder may have evicted one
            if cut is not None:  # the blocks first, each durable before the manifest that names it
                pinned = await self._put_blocks(cut, folder, ident, kw, written)
                planned = cut.manifest()
                # never publish a manifest our readers would refuse (its key chain is hashed: off the loop)
                await off_loop(functools.partial(validate_header, planned[0]), compute=True)
            result = await self._write(path, ident, planned, **kw)
            self._check_pinned(pinned, path)
        except BaseException:
            # No durable file the index does not know is left: a manifest published, but naming a block found bad
            # meanwhile, or cancelled after its rename (a queue closing on its timeout). Unlinked off the loop and
            # within the deadline (the disk may be what hung), with the blocks it wrote that nothing names.
            self._doomed.add(path)
            self._unpin(pinned)
            await self.delete_doomed_async()
            raise
        finally:
            self.release_folder(folder)
        entry = self.index.add(path, result.header, time.time())  # no await between the save's end and this
        self._unpin(pinned)
        if pin:
            self._mark_pin(path, True)
        self.counters.stored += 1
        self._wrote(result.file_bytes)
        self._ok()
        self._added(entry, logical, max(held * self.block_tokens, self._settle_new(entry, result.header)))
        if cut is not None:
            for listener in self.listeners:
                listener.stored(entry, written, cut.root)
        try:
            if pin:
                await self._save_pins()
            await self.delete_doomed_async()
        except asyncio.CancelledError:  # the entry is stored and indexed: say so (the unlinks still finish)
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
        except (OSError, errors.StorageError) as exc:  # stored, indexed, pinned in memory: only the pins file failed
            log.warning("the pins file could not be written (the pin holds until a restart): %s", exc)
        return result

    def _check_pinned(self, pinned: list[Block], path: str) -> None:
        """Every block a manifest names is still the one indexed: a block found bad while the manifest was written
        (a restore's read, the scrub) left the index though the put held it."""
        if gone := [rec for rec in pinned if self.index.blocks.get(rec.key) is not rec]:
            raise errors.BlockMissing(f"block {gone[0].key.hex()} was found bad while the entry was written", path=path)

    async def _put_blocks(
        self, cut: Split, folder: str, ident: fmt.Identity, kw: dict[str, Any], written: list[Block]
    ) -> list[Block]:
        """Write the blocks of ``cut`` not on disk yet (added to ``written``); every block it names is pinned until
        its manifest is indexed."""
        pinned: list[Block] = []
        # received bytes only (a batched save): a block's cut touches nothing of an engine's, so it may run on a thread
        missing = [i for i, k in enumerate(cut.keys) if not self.index.owns(k)]
        ahead = _Ahead(cut, missing, kw["batch_bytes"] > 0)
        # on ENOSPC, room for what the put still writes (the missing blocks left and the manifest), at once
        each = cut.block_bytes
        room = cut.header.data_bytes - len(cut.keys) * each + len(missing) * each
        try:
            for i, key in enumerate(cut.keys):
                rec = self.index.blocks.get(key)
                if rec is None or not rec.owned:
                    bpath = os.path.join(folder, blocks.block_name(key))
                    block = await ahead.take(i)  # and the next one's cut starts, to overlap this write
                    try:
                        result = await self._write(bpath, ident, block, room=room, sync_folder=False, **kw)
                    except BaseException:  # cancelled after its thread published it: never indexed, so it goes
                        self._doomed.add(bpath)  # (its name is this put's alone: a random suffix)
                        raise
                    room -= each
                    rec = self._add_block(key, bpath, result.file_bytes)
                    written.append(rec)
                    self.counters.blocks_written += 1
                    self._wrote(result.file_bytes)
                else:
                    self.counters.blocks_reused += 1
                rec.pins += 1
                pinned.append(rec)
            if written or not all(rec.synced for rec in pinned):  # one folder sync makes their names durable
                await self._sync_folder(folder)  # (another put's blocks too, found before its own sync was done)
                for rec in pinned:
                    rec.synced = True
        except BaseException:
            self._unpin(pinned)
            raise
        finally:
            try:
                await ahead.close()
            except BaseException:  # cancelled here, after its blocks were pinned: the put fails, its pins go
                self._unpin(pinned)
                raise
        return pinned

    # --- files from another tier ------------------------------------------------------------------

    async def adopt(
        self,
        ident: fmt.Identity,
        namespace: str,
        manifest: bytes,
        fetched: AsyncIterable[dict[bytes, bytes]],
        on_bad: Callable[[bytes | None, errors.FileFormatError], None] | None = None,
    ) -> Entry:
        """Keep a manifest fetched from another tier, with the blocks it names that this store lacks, which
        ``fetched`` hands over in batches (by key) while the next ones are still on their way. Each file is checked
        whole in memory first (header, rules, every tensor hash; a block: that it is the one asked for, of this
        identity and namespace); each batch is then written, all its files before any is synced
        (``fileio.publish_all``); once every block is held, the folder is synced, and the manifest, its blocks
        checked against it, written and renamed last: the order of a put. A check that fails raises
        (``FileFormatError`` for wrong bytes, ``BlockMissing`` for a block neither held nor fetched), as does
        ``fetched``, and leaves nothing behind. ``on_bad(key, error)`` is told first when a fetched file is bad in
        itself: a block (its key), or the manifest (None); not when files disagree, or one held here is at fault."""
        scope = (identity_fingerprint(ident), namespace)
        m = await _check_fetched(manifest, scope, None, on_bad)
        if m.blocks is None:
            raise errors.BlockInvalid("a fetched manifest names no blocks")
        folder = self.folder(ident, namespace)
        path = self.new_path(ident, namespace)
        pinned = [self.index.blocks[k] for k in m.blocks.keys if self.index.owns(k)]
        for rec in pinned:
            rec.pins += 1
        # the leading tokens held before the fill: not new (found in review: a fill under a shared system prompt
        # counted the prompt as unique again, and write amplification read below 1)
        lead = next((i for i, k in enumerate(m.blocks.keys) if not self.index.owns(k)), len(m.blocks.keys))
        held, named = {rec.key for rec in pinned}, set(m.blocks.keys)
        written: list[Block] = []  # the blocks this adopt wrote (its listeners are told of them)
        self.claim_folder(folder)
        try:
            await self._make_folder(folder)
            async for batch in fetched:
                new = {k: v for k, v in batch.items() if k not in held and k in named}
                pinned += (got := await self._adopt_blocks(new, scope, folder, on_bad))
                written += got
                held.update(new)
            if missing := [k for k in m.blocks.keys if k not in held]:
                raise errors.BlockMissing(f"block {missing[0].hex()} is neither held nor fetched")
            await self._io(lambda: fileio.sync_dir(self.ops, folder, self.durability), "a folder's sync")
            for rec in pinned:
                rec.synced = True
            await self._io(functools.partial(self._check_named, m, path), "a manifest's check", background=True)
            await self._io(
                functools.partial(self._write_file, path, manifest), "a manifest's write", background=True, late=[path]
            )
            await self._io(lambda: fileio.sync_dir(self.ops, folder, self.durability), "a folder's sync")
            self._check_pinned(pinned, path)
        except BaseException:
            self._doomed.add(path)  # as a put's: off the loop, within the deadline
            self._unpin(pinned)
            await self.delete_doomed_async()
            raise
        finally:
            self.release_folder(folder)
        entry = self.index.add(path, m, time.time())
        self._unpin(pinned)
        self.counters.adopted += 1
        self._wrote(len(manifest))  # a fill's files wear the disk as a put's do (found in review: not counted)
        self._added(entry, blocks.cache_bytes(m), max(lead * m.blocks.size, self._settle_new(entry, m)))
        for listener in self.listeners:  # this host holds them now (the shared tier's routers hear of it)
            listener.adopted(entry, written)
        await self.delete_doomed_async()
        return entry

    async def _adopt_blocks(
        self,
        new: dict[bytes, bytes],
        scope: tuple[str, str],
        folder: str,
        on_bad: Callable[[bytes | None, errors.FileFormatError], None] | None,
    ) -> list[Block]:
        """Fetched blocks checked (on worker threads), published in ``folder``, and held: their records, pinned."""
        await asyncio.gather(*(_check_fetched(v, scope, k, on_bad) for k, v in new.items()))
        names = {k: os.path.join(folder, blocks.block_name(k)) for k in new}
        files = [(names[k], v) for k, v in new.items()]
        await self._io(
            lambda: fileio.publish_all(self.ops, files, self.durability),
            "fetched blocks' writes",
            background=True,
            late=list(names.values()),
        )
        recs = []
        for k, v in new.items():
            recs.append(rec := self._add_block(k, names[k], len(v)))
            rec.pins += 1
            self.counters.blocks_fetched += 1
            self._wrote(len(v))
        return recs

    def _settle_new(self, entry: Entry, header: fmt.Header) -> int:
        """``entry`` just joined the index: what it replaces goes, then what the quota and the cap need; the most
        tokens an entry it superseded held."""
        held = self._supersede(entry, has_attachments=bool(header.attachments))
        self._evict_to_quota(entry)
        self._evict_own_to_cap(entry)
        self.evict_to_cap(keep=entry)
        return held

    def _write_file(self, path: str, data: bytes) -> None:
        """``data`` published at ``path``, durably (blocking: a worker thread)."""
        fileio.publish_bytes(self.ops, path, data, self.durability)

    def _check_named(self, m: fmt.Header, path: str) -> None:
        """Each block a manifest names is on disk and is the one it names (headers only: the new ones were
        checked whole, the others when they were written)."""
        assert m.blocks is not None
        resolve = lambda k: r.path if (r := self.index.blocks.get(k)) is not None else None  # noqa: E731
        assemble.checked_blocks(m, path, resolve, lambda p, _: read_header(p, self.ops), len(m.blocks.keys))

    def _added(self, entry: Entry, logical: int, held: int) -> None:
        """``entry`` (``logical`` cache bytes) stored, of which the store held ``held`` tokens before: the cache
        bytes of the rest are new (``unique_added``)."""
        self.counters.unique_added += logical * max(entry.ntokens - held, 0) // max(entry.ntokens, 1)

    def _wrote(self, nbytes: int) -> None:
        self.counters.bytes_written += nbytes
        self.wear.add(nbytes)

    def _unpin(self, pinned: list[Block]) -> None:
        """A put is done with its blocks: one that no manifest names (the put failed) goes."""
        for rec in pinned:
            rec.pins -= 1
            self._reclaim_if_unused(rec)
        pinned.clear()

    async def _sync_folder(self, folder: str) -> None:
        """fsync ``folder``; a failure fails the put, never retried (not even after making room: a second fsync
        may succeed without the names the first one failed to make durable)."""
        try:  # bounded like every step: a hung disk fails the put, it never holds the writer (found in review)
            await self._io(lambda: fileio.sync_dir(self.ops, folder, self.durability), "a folder's sync")
        except Exception as exc:
            self._count_error(exc)
            raise

    async def _make_folder(self, folder: str, room: bool = False) -> None:
        """Create a claimed entry folder and its model folder (with ``room``, ENOSPC makes room and tries again),
        then make their names durable: a failed fsync is never retried (a second may succeed without them)."""
        deadline = time.monotonic() + (self.io_timeout if self.io_timeout is not None else math.inf)
        while self._folders.removing(folder):  # the sweep's rmdir of it under way: it may be gone after
            if time.monotonic() > deadline:
                raise errors.StorageTimeout(f"the removal of the empty folder {folder} did not end: the disk is hung")
            await asyncio.sleep(FOLDER_WAIT_S)
        # the check off the loop, within the deadline (found in review: a stat a stalled mount held froze the loop)
        if folder in self._durable_folders and await self._io(lambda: os.path.isdir(folder), "a folder's check"):
            return

        created: list[str] = []  # by either attempt: each one's parent is synced too

        async def create() -> None:
            none = fileio.Durability.NONE  # created only: synced below, where a failure is not retried
            created.extend(await self._io(lambda: fileio.make_dirs(self.ops, folder, none), "a folder's creation"))

        await (self._with_room(create, 0) if room else create())
        try:
            await self._io(lambda: self._sync_folder_path(folder, created), "a folder's sync")
        except Exception as exc:
            self._count_error(exc)
            raise

    async def _write(
        self,
        path: str,
        ident: fmt.Identity,
        planned: tuple[fmt.Header, list[AnySource]],
        room: int | None = None,
        **kw: Any,
    ) -> SaveResult:
        """Save into a folder made already; on ENOSPC evict ``room`` bytes (default: the file's) once and retry.
        Every failure is counted."""

        async def save() -> SaveResult:
            return await save_async(
                path, [], [], identity=ident, durability=self.durability, provider=self._provider,
                ops=self.ops, planned=planned, step_deadline=self.io_timeout, **kw,
            )  # fmt: skip

        return await self._with_room(save, planned[0].data_bytes if room is None else room)

    async def _with_room(self, work: Callable[[], Awaitable[T]], needed: int) -> T:
        """Run ``work``; on ENOSPC evict least recently used entries worth ``needed`` bytes once and run it again.
        Every failure is counted."""
        for attempt in (1, 2):
            try:
                return await work()
            except errors.DiskFull as exc:
                if attempt == 2 or not self.make_room(needed):
                    self._count_error(exc)
                    raise
                await self.delete_doomed_async()
                unpin(exc)  # dropped here: its frames must not keep this attempt's bytes (or a cycle) alive
                log.warning("disk full: evicted old entries, retrying the write")
            except (errors.Timeout, errors.LeaseRefused):  # an engine's lease not granted (in time): not the disk's
                raise
            except Exception as exc:
                self._count_error(exc)
                raise
        raise AssertionError("unreachable")

    def _count_error(self, exc: Exception) -> None:
        """A failed write: counted by code, logged when a run starts and every ``STORE_ERROR_RUN_LOG`` after."""
        self.counters.store_errors += 1
        code = exc.code if isinstance(exc, errors.SpillError) else "error"
        self.counters.errors[code] = self.counters.errors.get(code, 0) + 1
        self._error_run += 1
        if self._error_run == 1:
            log.warning("a write to %s failed: %s [%s]", self.root, exc, code)
        elif self._error_run % STORE_ERROR_RUN_LOG == 0:
            log.error("%d writes to %s failed in a row; the last: %s [%s]", self._error_run, self.root, exc, code)

    def _ok(self) -> None:
        if self._error_run > 1:
            log.warning("writes to %s succeed again after %d failures in a row", self.root, self._error_run)
        self._error_run = 0

    def has_block(self, key: bytes) -> bool:
        """This store holds block ``key`` as its own (one another writer put here is fetched or written anew)."""
        return self.index.owns(key)

    def leading_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a chain, in order) this store holds, from the first on."""
        return self.index.leading_blocks(keys)

    def held_rows(self, header: fmt.Header) -> int:
        """How many leading tokens of a planned entry's ``header`` this store holds as blocks: the rows of its
        positional caches a writer need not have (a multiple of ``block_tokens``; 0 without blocks)."""
        return self.hold_blocks(header, pin=False)[0]

    def hold_blocks(self, header: fmt.Header, pin: bool = True) -> tuple[int, list[Block]]:
        """``held_rows``, and (with ``pin``) those blocks pinned until ``release_blocks``: a writer told it need not
        send their rows keeps them on disk until its put has named them or is given up (found in review: an
        eviction meanwhile failed the daemon's non-droppable spills with ``HeldBlockGone``, and nothing resent)."""
        cut = blocks.split(header, [], self.block_tokens) if self.block_tokens else None
        n = self._held_blocks(cut)
        held = [self.index.blocks[k] for k in cut.keys[:n]] if cut is not None and pin else []
        for rec in held:
            rec.pins += 1
        return n * self.block_tokens, held

    def release_blocks(self, held: list[Block]) -> None:
        """``hold_blocks``' pins go (a block no manifest names then goes too)."""
        self._unpin(held)

    def _check_held(self, cut: Split | None, held_rows: int) -> int:
        """The leading blocks of ``cut`` on disk; ``HeldBlockGone`` if fewer than the ``held_rows`` a client left out
        (they are pinned from the put's first block on, so this is checked until then)."""
        held = self._held_blocks(cut)
        if held_rows and (cut is None or held * cut.size < held_rows):
            raise errors.HeldBlockGone(
                f"a block of the first {held_rows} tokens went (evicted) after the client was told it was held"
            )
        return held

    def _held_blocks(self, cut: Split | None) -> int:
        """How many leading blocks of ``cut`` the store holds already."""
        if cut is None:
            return 0
        return self.leading_blocks(cut.keys)

    def budget_spent(self) -> bool:
        """The last 24 hours' writes reached ``--write-budget``: optional writes (a droppable spill, a fill from the
        shared tier) are not made."""
        return self.write_budget is not None and self.wear.last_day() >= self.write_budget

    def admits_fill(self, ident: fmt.Identity, namespace: str, tokens: Tokens, held: int) -> bool:
        """Whether the write gate lets a fill of ``tokens`` write, this store holding their first ``held`` blocks:
        as for a droppable spill, the prefix ending with the first block it would add was asked for
        ``--admit-after`` times (by lookups of ``namespace``; the one the fill serves was counted already)."""
        gate = self.admission
        return gate is None or gate.admits(self._ask_scope(ident, namespace), tokens, held)

    def _admit(self, header: fmt.Header, held: int) -> None:
        """Shed a droppable spill whose first new block's prefix was not asked for ``--admit-after`` times."""
        assert self.admission is not None
        if not self.admission.admits(self._ask_scope(header.identity), header.tokens, held):
            self.counters.dropped_admit += 1
            raise errors.NotAdmitted(
                f"the prefix of its new blocks was not asked for {self.admission.after} times yet (--admit-after): "
                "a droppable spill is not written"
            )

    def _ask_scope(self, ident: fmt.Identity, namespace: str | None = None) -> str:
        """What asks are counted within: the model and the namespace."""
        return f"{identity_fingerprint(ident)}/{ident.namespace if namespace is None else namespace}"

    def _supersede(self, new: Entry, *, has_attachments: bool) -> int:
        """Remove the entries ``new`` replaces (exact copies; prefixes it extends): the most tokens one held."""
        # an entry with blocks that is a prefix of this one ends at one of its blocks (keys chain the whole prefix)
        held = 0
        cands = list(self.index.by_start.get(start_key(new.namespace, new.tokens), {}).values())
        for k in new.blocks:
            cands += self.index.by_last.get(k, {}).values()
        for e in cands:
            if e is new or e.fingerprint != new.fingerprint or e.namespace != new.namespace or e.path in self._pins:
                continue
            if e.codec_provider != new.codec_provider:
                continue  # another engine's codecs: its readers cannot use ours
            if _restorable(new) < _restorable(e):
                continue  # it records those tokens, but its caches hold fewer: it serves less than e does
            if e.attachments and not has_attachments:
                continue  # it carries what the new one does not (found in review: a draft's KV was lost)
            if e.trimmable and (not new.trimmable or new.min_reusable > e.min_reusable):
                continue  # it serves shorter prefixes the new one cannot (found in review: they stopped hitting)
            exact = e.ntokens == new.ntokens and common_prefix(e.tokens, new.tokens) == new.ntokens
            ancestor = (
                e.ntokens < new.ntokens
                and new.trimmable
                and not has_attachments
                and e.checkpoint is None
                and new.min_reusable <= e.ntokens
                and common_prefix(e.tokens, new.tokens) == e.ntokens
            )
            if exact or ancestor:
                self.counters.superseded += 1
                held = max(held, e.ntokens)
                self._remove(e)
        return held

    def evict_to_cap(self, keep: Entry | None = None) -> int:
        """Take least recently used entries out of the index until the root fits the disk cap.

        Their files join the ones to delete (``delete_doomed_async``, or at once by the sync callers).
        """
        return self._evict_until(self.index.by_path.values(), lambda: self.total_bytes <= self.disk_cap, keep)

    def _evict_until(self, entries: Iterable[Entry], fits: Callable[[], bool], keep: Entry | None) -> int:
        """Evict ``entries`` in eviction order (all but ``keep``) until ``fits()``: how many went."""
        n = 0
        if fits():
            return 0
        for e in self._evict_order(entries):
            if fits():
                break
            if e is not keep:
                self._evict(e)
                n += 1
        return n

    def _evict(self, e: Entry, tell: bool = True) -> None:
        """Out of the index (remembered, to explain misses), its file and the blocks no other entry names doomed;
        listeners told (``StoreListener.evicted``) unless ``tell`` is False (room for a write, or an operator's
        ``evict``: unlinked at once)."""
        listeners = self.listeners if tell else []
        named = self.named_blocks(e) if listeners else []
        self._remember_evicted(e)
        self._remove(e)
        self.counters.evicted += 1
        for listener in listeners:
            listener.evicted(e, named)

    def keep_file(self, path: str) -> None:
        """Hold off the unlink of ``path`` (a file of an entry just evicted) until as many ``release_file``."""
        self._doomed.keep(path)

    def release_file(self, path: str) -> None:
        """One ``keep_file`` of ``path`` done: once none is left, a doomed file joins those to unlink."""
        self._doomed.release(path)

    def _evict_order(self, entries: Iterable[Entry]) -> list[Entry]:
        """Least recently used first, the newest pins of the whole store (within the pin cap, with their blocks)
        last."""
        return evict_order(entries, self._pins, self._on_disk, self.pin_cap, self.index.by_path.values())

    def _on_disk(self, e: Entry) -> tuple[int, dict[bytes, int]]:
        """``e``'s own bytes, and its blocks' by key."""
        return e.nbytes, {k: rec.nbytes for k in e.blocks if (rec := self.index.blocks.get(k)) is not None}

    # --- pins -------------------------------------------------------------------------

    def is_pinned(self, e: Entry) -> bool:
        return e.path in self._pins

    def pin(self, path: str, on: bool = True) -> bool:
        """Pin (or unpin) an indexed entry: evicted last and never superseded; kept across restarts. False if the
        path is not an entry here. Writes the pins file (blocking: ``pin_async`` on a loop)."""
        if not self._set_pin(path, on):
            return False
        self._write_pins()
        return True

    async def pin_async(self, path: str, on: bool = True) -> bool:
        if not self._set_pin(path, on):
            return False
        await self._save_pins()
        return True

    async def _save_pins(self) -> None:
        """Write the pins file with the changes as they are once this write's turn comes (found in review: two
        writes at once could rename the older set last, and a pin was lost at the next start)."""
        async with self._pins_written:
            changes, known = dict(self._pin_changes), self._pins | self._unjudged
            await self._io(lambda: self._update_pins_file(changes, known), "the pins file")
            self._pins_saved(changes)

    def _write_pins(self) -> None:
        """``_save_pins``, blocking."""
        changes = dict(self._pin_changes)
        self._update_pins_file(changes, self._pins | self._unjudged)
        self._pins_saved(changes)

    def _update_pins_file(self, changes: dict[str, bool], known: set[str]) -> None:
        """One read-merge-replace of the pins file at a time, on whatever thread: a write past the I/O deadline
        goes on in its thread, and the next one waits for it (found in review: it landed after a later one and
        renamed the older set over it; that pin was gone at the next start)."""
        with self._pins_file:
            update_pins(self.root, changes, known, self.ops, self.durability)

    def _pins_saved(self, changes: dict[str, bool]) -> None:
        """``changes`` are in the file: pending no more (one changed again meanwhile still is). The file is merged,
        never rewritten from this index alone (found in review: a pin the scan could not judge, or another
        writer's, was dropped)."""
        for p, on in changes.items():
            if self._pin_changes.get(p) is on:
                del self._pin_changes[p]

    def _mark_pin(self, path: str, on: bool) -> None:
        """This process pins or unpins ``path``: the next pins file write applies it."""
        (self._pins.add if on else self._pins.discard)(path)
        self._pin_changes[path] = on

    async def _io(self, fn: Callable[[], T], what: str, background: bool = False, late: Sequence[str] = ()) -> T:
        """``fn`` (blocking file work) on a worker thread within the I/O deadline (``StorageTimeout`` past it).
        ``late``: the files ``fn`` publishes; past the deadline its caller has given up on them, so once ``fn``
        ends they join the files to unlink (the next ``delete_doomed_async``; a scan judges them after a crash)."""

        def doom() -> None:
            for path in late:
                if path not in self.index.by_path:
                    self._doomed.add(path)

        try:
            return await within(
                off_loop(fn, background=background), self.io_timeout, what, on_late=doom if late else None
            )
        except asyncio.CancelledError:  # raised once ``fn`` has ended (no cancel stops a thread): given up on too
            doom()
            raise

    def _set_pin(self, path: str, on: bool) -> bool:
        if path not in self.index.by_path:
            return False
        self._mark_pin(path, on)
        return True

    def namespace_bytes(self, namespace: str) -> int:
        """Bytes on disk of one namespace (all models; each of its blocks once)."""
        return self.index.namespace_bytes(namespace_hash(namespace))

    def _evict_to_quota(self, new: Entry) -> int:
        """Least recently used entries of ``new``'s namespace go until it fits its quota: one tenant's spills never
        evict another's (the disk cap, over all of them, is checked after)."""
        quota, ns = self.namespace_quota, ns_dir(new.path)
        if quota is None or self.index.namespace_bytes(ns) <= quota:
            return 0
        n = self._evict_until(self._entries_in(ns), lambda: self.index.namespace_bytes(ns) <= quota, new)
        self.counters.quota_evicted += n
        return n

    def _evict_own_to_cap(self, new: Entry) -> int:
        """With quotas set, a put that passes the disk cap evicts its own namespace's entries first, but for the pins
        kept within ``--pin-cap``; another tenant's go only when it has none left (quotas that sum past the cap).
        Found in review: a tenant within its quota evicted another's entries; then, one that kept its own pins
        beyond the pin cap, which are evicted like the rest."""
        if self.namespace_quota is None or self.total_bytes <= self.disk_cap:
            return 0
        kept = protected(self.index.by_path.values(), self._pins, self._on_disk, self.pin_cap)
        mine = [e for e in self._entries_in(ns_dir(new.path)) if e.path not in kept]
        return self._evict_until(mine, lambda: self.total_bytes <= self.disk_cap, new)

    def _entries_in(self, ns: str) -> list[Entry]:
        """The entries of the namespace folder ``ns``."""
        return [e for e in self.index.by_path.values() if ns_dir(e.path) == ns]

    def make_room(self, nbytes: int) -> bool:
        """After ENOSPC: evict least recently used entries worth ``nbytes`` (at least one); False if none."""
        start = self.total_bytes
        gone = 0
        for e in self._evict_order(self.index.by_path.values()):
            if gone and start - self.total_bytes >= nbytes:
                break
            self._evict(e, tell=False)  # the disk is full: its files must go now, not after a listener reads them
            gone += 1
        return gone > 0

    def _remember_evicted(self, e: Entry) -> None:
        self._evicted.setdefault((e.fingerprint, e.namespace), deque(maxlen=EVICTED_MEMORY)).append(e.tokens)

    def _forget(self, e: Entry) -> None:
        """Out of the index (its file stays); its blocks that no manifest names (or put pins) any more go."""
        if self.index.by_path.get(e.path) is e:
            self._drop_pin(e)
            for rec in self.index.remove(e):
                self._reclaim_if_unused(rec)

    def _drop_pin(self, e: Entry) -> None:
        """``e`` leaves the index: a pin of a file of ours goes with it (the next pins file write drops it); another
        writer's file stays, and its pin is that writer's to judge."""
        if e.path not in self._pins:
            return
        if e.owned:
            self._mark_pin(e.path, False)
        else:
            self._pins.discard(e.path)
            self._unjudged.add(e.path)

    def _remove(self, e: Entry) -> None:
        """Out of the index now; the file joins those to delete, if it is ours (``Entry.owned``)."""
        self._forget(e)
        if e.owned:
            self._doomed.add(e.path)

    def _delete_doomed(self) -> None:
        self._unlink_later(unlink_all(self.ops, self._doomed.take()))

    def _unlink_later(self, failed: list[str]) -> None:
        """Files an unlink refused (EIO, EROFS): tried again at the next removal, each said once."""
        if new := [p for p in failed if p not in self._unlink_refused]:
            log.warning("%d files of entries or blocks that left the store could not be removed now (%s, ...): "
                        "tried again later", len(new), new[0])  # fmt: skip
        self._unlink_refused = set(failed)  # (those removed since need not be remembered)
        for p in failed:
            self._doomed.add(p)

    async def delete_doomed_async(self) -> None:
        """Unlink the files of entries that left the index, on a worker thread."""
        if doomed := self._doomed.take():
            try:
                self._unlink_later(await self._io(lambda: unlink_all(self.ops, doomed), "unlinks"))
            except errors.StorageTimeout as exc:  # the entries are out of the index: their files go when it can
                log.warning("%d files not removed yet: %s", len(doomed), exc)
                for p in doomed:  # tried again next time (found in review: dropped, as a refused unlink was)
                    self._doomed.add(p)

    def remove_where(self, pred: Callable[[Entry], bool]) -> int:
        n = self._drop_where(pred)
        self._delete_doomed()
        return n

    async def remove_where_async(self, pred: Callable[[Entry], bool]) -> int:
        n = self._drop_where(pred)
        await self.delete_doomed_async()
        return n

    def _drop_where(self, pred: Callable[[Entry], bool]) -> int:
        gone = [e for e in self.index.by_path.values() if pred(e)]
        for e in gone:
            self._remove(e)
        return len(gone)

    async def evict_async(
        self,
        fingerprint: str | None = None,
        older_than_s: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[int, int]:
        """Remove entries of one identity folder and/or unused for a while, and clear emptied folders: the index
        changes here (``EVICT_BATCH`` entries a turn of the
        loop), every unlink and the sweep on a worker. ``progress(files, bytes)`` left to unlink is called from
        that worker, first before any unlink, then at most every ``UNLINK_PROGRESS_S``."""
        match = self._evict_match(fingerprint, older_than_s)
        named: dict[int, Block] = {}  # the blocks of the entries this evict takes out (others may go meanwhile)
        gone: list[Entry] = []
        for i in range(0, len(match), EVICT_BATCH):
            gone += self._evict_entries(match[i : i + EVICT_BATCH], named)
            await asyncio.sleep(0)  # other requests are answered between two batches
        # the bytes freed: the entries' files, and the blocks that went with them (no other entry named them)
        sizes = {e.path: e.nbytes for e in gone}
        sizes |= {r.path: r.nbytes for r in named.values() if r.owned and self.index.blocks.get(r.key) is not r}
        doomed = self._doomed.take()

        def work() -> list[str]:
            failed = unlink_all(self.ops, doomed, sizes, progress)
            self.remove_empty_folders()
            return failed

        failed = await off_loop(work)
        self._unlink_later(failed)
        return len(gone), sum(sizes.values()) - sum(sizes.get(p, 0) for p in failed)

    def _evict_match(self, fingerprint: str | None, older_than_s: float | None) -> list[Entry]:
        cutoff = time.time() - older_than_s if older_than_s is not None else None
        return [
            e for e in self.index.by_path.values()
            if (fingerprint is None or e.fingerprint == fingerprint) and (cutoff is None or e.last_used < cutoff)
        ]  # fmt: skip

    def _evict_entries(self, match: Sequence[Entry], named: dict[int, Block]) -> list[Entry]:
        """Evict those of ``match`` still indexed (one superseded or evicted since the list was made is not counted
        again, nor its blocks, found in review), their blocks added to ``named``; the ones evicted here."""
        gone = [e for e in match if self.index.by_path.get(e.path) is e]
        named |= {id(rec): rec for e in gone for k in e.blocks if (rec := self.index.blocks.get(k)) is not None}
        for e in gone:
            # an operator's removal, not the cap's nor a quota's: no listener keeps its files (found in review: with
            # --remote-push evicted, ``spilld evict`` pushed up to 8 of the entries it removed to the shared tier)
            self._evict(e, tell=False)
        return gone

    def remove_empty_folders(self) -> None:
        """Folders of models no longer in use go when their last entry does (blocking: a worker thread).

        A folder a save has claimed is left, and so is its model folder: the save may be about to write there.
        """
        remove_empty_folders(self.root, self._folders)

    # --- generation checkpoints -------------------------------------------------------

    def find_checkpoint(self, ident: fmt.Identity, key: str, *, codec_provider: str | None = None) -> Entry | None:
        """The latest checkpoint of generation ``key`` this model (and ``codec_provider``, default this store's) can
        resume: most tokens, then most recently used. Only that generation's entries are looked at."""
        fp, provider = identity_fingerprint(ident), codec_provider or self.provider_id
        found = [
            e
            for e in self.index.checkpoints.get(checkpoint_namespace(key), {}).values()
            if e.fingerprint == fp and e.codec_provider == provider
        ]
        return max(found, key=lambda e: (e.ntokens, e.last_used), default=None)

    def remove_checkpoints(self, key: str) -> int:
        ns = checkpoint_namespace(key)
        return self.remove_where(lambda e: e.namespace == ns)

    async def remove_checkpoints_async(self, key: str) -> int:
        ns = checkpoint_namespace(key)
        return await self.remove_where_async(lambda e: e.namespace == ns)

    # --- quarantine ---------------------------------------------------------------------

    def quarantine(self, path: str, why: BaseException) -> None:
        """Move a bad file aside (never served again) and count it."""
        self._quarantine_index(path, why)
        self.counters.quarantine_removed += move_aside(self.root, path, self.quarantine_cap, self.ops)

    async def quarantine_async(self, path: str, why: BaseException) -> None:
        """``quarantine`` with the move on a worker thread; the index changes here."""
        self._quarantine_index(path, why)
        try:  # out of the index already: a hung disk delays the move, never the caller
            move = lambda: move_aside(self.root, path, self.quarantine_cap, self.ops)  # noqa: E731
            self.counters.quarantine_removed += await self._io(move, "a move to quarantine")
        except errors.StorageTimeout as exc:
            log.warning("%s not moved aside yet: %s", path, exc)

    def _quarantine_index(self, path: str, why: BaseException) -> None:
        e = self.index.by_path.get(path)
        if e is not None:
            self._forget(e)
        self.counters.quarantined += 1
        log.warning("quarantined %s: %s", path, why)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "entries": self.count,
            "bytes": self.total_bytes,
            "disk_cap": self.disk_cap,
            "hits": c.hits,
            "misses": dict(c.misses),
            "stored": c.stored,
            "superseded": c.superseded,
            "evicted": c.evicted,
            "quarantined": c.quarantined,
            "quarantine_removed": c.quarantine_removed,
            "reaped_temp": c.reaped_temp,
            "blocks": len(self.index.blocks),
            "block_bytes": self.index.block_bytes,
            "bytes_written": c.bytes_written,
            "blocks_written": c.blocks_written,
            "blocks_reused": c.blocks_reused,
            "blocks_reclaimed": c.blocks_reclaimed,
            "blocks_fetched": c.blocks_fetched,
            "adopted": c.adopted,
            "written_day": self.wear.last_day(),
            "written_week": self.wear.last_week(),
            "write_budget": self.write_budget,
            "dropped_budget": c.dropped_budget,
            "admit_after": self.admission.after if self.admission is not None else 0,
            "dropped_admit": c.dropped_admit,
            "unique_added": c.unique_added,
            "namespace_quota": self.namespace_quota,
            "quota_evicted": c.quota_evicted,
            "pinned": len(self._pins),
            "pin_cap": self.pin_cap,
            "store_errors": c.store_errors,
            "errors": dict(c.errors),
        }


def _cut_block(cut: Split, i: int) -> tuple[fmt.Header, list[AnySource]]:
    block = cut.block(i)
    validate_header(block[0])  # its own key and chain included
    return block


class _Ahead:
    """The blocks of a put to write (``todo``), each cut and checked before its write. ``threaded``: on a compute
    thread, the next one's while this one is written (the loop is not held for it)."""

    def __init__(self, cut: Split, todo: list[int], threaded: bool) -> None:
        self._cut, self._todo, self._threaded = cut, todo, threaded
        self._tasks: dict[int, asyncio.Future[tuple[fmt.Header, list[AnySource]]]] = {}

    def _start(self, i: int) -> None:
        if i not in self._tasks:
            work = off_loop(functools.partial(_cut_block, self._cut, i), compute=True)
            self._tasks[i] = asyncio.ensure_future(work)

    async def take(self, i: int) -> tuple[fmt.Header, list[AnySource]]:
        """Block ``i``, cut and checked; the next block of ``todo`` starts its cut."""
        if not self._threaded:
            return _cut_block(self._cut, i)
        self._start(i)
        if (k := bisect.bisect_right(self._todo, i)) < len(self._todo):
            self._start(self._todo[k])
        return await self._tasks.pop(i)

    async def close(self) -> None:
        """Cancel a cut started ahead and wait for it (the put failed or the block appeared meanwhile)."""
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()


def _checked_fetch(data: bytes, scope: tuple[str, str], key: bytes | None) -> fmt.Header:
    """A fetched file checked whole in memory: block ``key`` (None: a manifest) of identity and namespace
    ``scope``."""
    header = validate.check_file_bytes(data)
    if (identity_fingerprint(header.identity), header.identity.namespace) != scope:
        raise errors.BlockInvalid("a fetched file of another identity or namespace")
    if (header.block.key if header.block is not None else None) != key:
        raise errors.BlockKeyMismatch("a fetched file is not the one asked for")
    return header


async def _check_fetched(
    data: bytes,
    scope: tuple[str, str],
    key: bytes | None,
    on_bad: Callable[[bytes | None, errors.FileFormatError], None] | None,
) -> fmt.Header:
    """``_checked_fetch`` on a worker thread; ``on_bad(key, error)`` told of a refusal before it is raised."""
    try:
        return await off_loop(functools.partial(_checked_fetch, data, scope, key), background=True)
    except errors.FileFormatError as exc:
        if on_bad is not None:
            on_bad(key, exc)
        raise


def _restorable(e: Entry) -> int:
    """The tokens a restore of ``e`` can serve: all it records, or only its caches' rows (``Entry.restorable``),
    which it reaches by a cut: none when it cannot be cut."""
    return e.held if e.restorable is None or e.trimmable else 0
