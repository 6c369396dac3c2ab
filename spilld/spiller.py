"""Embedded mode: a queue, a store and a lease for one engine in one process.

async with Spiller(folder, identity=spilld.model_identity(model, tokenizer), lease=ThreadLockLease(lock)) as sp:
    sp.spill(tokens, cache)                  # returns at once; written behind
    loaded = await sp.load(tokens)           # longest usable prefix, or None

The same API as the daemon's clients (``spilld.api``); ``await Spiller.open(folder, ...)`` without ``async with``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import api, errors, fileio
from . import format as fmt
from .blocks import DEFAULT_BLOCK_TOKENS
from .codecs import CodecProvider, default_provider
from .config import check_admit_after, check_size
from .entries import Hit, Miss, MissReason, check_namespace, checkpoint_namespace
from .lease import NoLease, RunStep, off_loop
from .loader import Loaded
from .lockfile import FileLock, holder_pid
from .queue import DEFAULT_QUEUE_CAP, DrainReport, Settled, SpillItem, SpillQueue, matching, of_generation
from .saver import Attachment, Staging, token_list
from .snapshot import AnyFuture, Handoffs, item_bytes, new_item, on_loop, planned
from .store import Store

log = logging.getLogger("spilld.spiller")

# A Spiller opened while another scans the folder (holding its lock alone) waits this long for a shared hold; held
# alone longer, the folder is a daemon's (it holds the lock for its life)
SHARE_WAIT_S = 60.0
SHARE_RETRY_S = 0.05
CANCELLED_WEAR_S = 5.0  # the most a cancelled close waits for the run's bytes to reach the wear file


class Spiller:
    """Write-behind spilling and prefix restore for one engine."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        identity: fmt.Identity,
        queue_cap: int = DEFAULT_QUEUE_CAP,
        disk_cap: int | None = None,
        lease: RunStep | None = None,
        write_in_lease: bool = False,
        durability: fileio.Durability | str = fileio.Durability.FSYNC,
        provider: CodecProvider | None = None,
        verify: bool = True,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        write_budget: int | None = None,
        admit_after: int = 0,
    ) -> None:
        """``write_budget``: bytes a day, past which droppable spills are shed (``WriteBudgetSpent``; None: no
        budget); ``admit_after``: the write gate, a droppable spill's new blocks written only once lookups asked for
        their prefix this often (``NotAdmitted``; 0: off). Both as the daemon's ``--write-budget`` and
        ``--admit-after``, checked as its ``Config`` checks them (ValueError), before the folder is made."""
        if write_budget is not None:
            check_size(write_budget, "write budget")
        check_admit_after(admit_after)
        self.identity = identity
        self.provider = provider or default_provider()
        self.store = Store(
            folder, disk_cap=disk_cap, durability=durability, provider=self.provider, verify=verify,
            block_tokens=block_tokens, write_budget=write_budget, admit_after=admit_after,
        )  # fmt: skip
        self.lease: RunStep = lease or NoLease()
        self.write_in_lease = write_in_lease
        self.queue = SpillQueue(queue_cap, self._write, bytes_of=self._bytes_of)
        self._staging = Staging()
        self._loop: asyncio.AbstractEventLoop | None = None
        # spill_threadsafe's futures, settled cancelled if the loop stops before they settle (watched once bound)
        self._handoffs = Handoffs()
        self._close_report: DrainReport | None = None  # the first close's, which a second one gives
        self._closed = False  # close has run: the folder's lock is let go, and nothing more is answered
        self._records: set[asyncio.Future[None]] = set()  # additions of the run's bytes to the wear file under way

    @classmethod
    async def open(cls, folder: str | os.PathLike[str], **kwargs: Any) -> Spiller:
        """Make a Spiller and start it: scan the folder (off the event loop), bind to the running loop."""
        return await cls(folder, **kwargs)._start()

    async def __aenter__(self) -> Spiller:
        return await self._start() if self._loop is None else self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self) -> Spiller:
        """Scan the folder (off the event loop), then bind to the running loop (spills wait for the scan).

        Until ``close`` the folder's lock is held shared, with any other Spillers writing there: no daemon starts on
        it and no other scan reaps it (the blocks of a put still under way would look like orphans). Only a Spiller
        that found the lock free scans with it held alone, so that its scan may reap. A folder a daemon serves is
        refused (``AlreadyRunning``): one owner per folder, whose files no other writer may count as its own."""
        lock, alone = self.store.lock, False
        try:
            alone = lock.try_acquire()
            if not alone:
                await self._share(lock)
        except errors.StorageError:  # a folder we may only read (no lock file can be made): restores still work
            pass
        try:
            await off_loop(self.store.scan)
        except BaseException:
            self.store.close()
            raise
        if alone and not lock.share():  # flock converts by letting go, then taking: another may come between
            self.store.disown_files()  # and may have scanned alone meanwhile: the files found are theirs too
            try:
                await self._share(lock)
            except BaseException:
                self.store.close()
                raise
        self._loop = asyncio.get_running_loop()
        self._handoffs = Handoffs.watching(self._loop)
        return self

    async def _share(self, lock: FileLock) -> None:
        """Hold ``lock`` shared. Another Spiller holds it alone while it scans (then shares it): wait for that, up to
        ``SHARE_WAIT_S``. Held alone longer, by a daemon for its life: ``AlreadyRunning``. Found in review: a
        Spiller wrote there as the daemon's guest, and after the daemon's restart both counted the guest's files
        as their own: one unlinked blocks the other's entries named, and spills reported stored were lost."""
        deadline = asyncio.get_running_loop().time() + SHARE_WAIT_S
        while not lock.try_acquire(shared=True):
            if asyncio.get_running_loop().time() >= deadline:
                pid = holder_pid(lock.path)
                raise errors.AlreadyRunning(
                    f"{self.store.root} is in use by another spilld (pid {pid if pid is not None else 'unknown'}) "
                    f"alone for over {SHARE_WAIT_S:g} s: a daemon serves it (spill through its socket: "
                    "spilld.Client, spilld.AsyncClient), or another Spiller's scan of it is long; or give this "
                    "Spiller a folder of its own"
                )
            await asyncio.sleep(SHARE_RETRY_S)

    # --- writing --------------------------------------------------------------------

    def _bytes_of(self, item: SpillItem) -> int:
        return item_bytes(item, self.provider)

    async def _write(self, item: SpillItem) -> Any:
        header, sources = planned(item)
        result = await self.store.put(
            [],
            [],
            self.identity,
            run_step=self.lease,
            write_in_lease=self.write_in_lease,
            planned=(header, sources),
            staging=self._staging,
            droppable=item.droppable,
            pin=item.pin,
        )
        # the entry as planned at the call, as a client's answer gives it (found in review: here the manifest's own
        # header, its blocks and tail; the file's is what ``spilld.load`` and ``inspect`` read)
        return dataclasses.replace(result, header=header)

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        namespace: str = "",
        key: str = "",
        droppable: bool = True,
        attachments: Sequence[Attachment] = (),
        checkpoint: fmt.GenerationCheckpoint | None = None,
        live: bool = False,
        pin: bool = False,
        behind: AnyFuture | None = None,
    ) -> asyncio.Future[Settled]:
        """Clone the caches, queue them and return at once with a future of the outcome.

        Call it on the event loop's thread; an engine decoding in a thread of its own calls
        ``spill_threadsafe`` (same arguments, a ``concurrent.futures.Future``).

        Whatever is saved is the state at this call: tokens, caches and
        attachments are evaluated or copied here, on the caller's thread.

        ``live=True`` is for caches the engine keeps extending (a write-behind
        snapshot): instead of views (which make the engine's next in-place
        update copy the whole buffer), append-only buffers (``KVCache``,
        ``QuantizedKVCache``, ``ConcatenateKVCache``) are read at write time,
        one piece per lease hold. Classes whose rows are overwritten in place
        (rotating rings, chunked windows, recurrent state, batches) are cloned
        here instead, and so is everything when there is no lease. A cut below
        the snapshot's length before it is written (even one grown back since,
        if made through ``trim``) fails the write.

        ``behind``: the future of an earlier droppable spill of the same entry made here (a write-behind). Where that
        one still stands for this spill it is kept in its place, made not droppable if this one is not, and this one
        is held, not written as well, until that one ends: if that one's write fails (or the write gate sheds it as
        it is written), this one is written in its place. Where it no longer can, this one is queued. When each way
        in keeps it: ``spill_threadsafe``. The future is then the one kept's.
        """
        item = new_item(
            self.identity, self.provider, tokens, caches, meta=meta, namespace=namespace, key=key,
            droppable=droppable, attachments=attachments, checkpoint=checkpoint, live=live, pin=pin,
            leased=not isinstance(self.lease, NoLease),
        )  # fmt: skip
        return self._handoffs.hand_over_here(self._bound(), item, behind, self.queue.enqueue, self.queue.keep)

    def spill_threadsafe(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        behind: concurrent.futures.Future[Settled] | None = None,
        **kw: Any,
    ) -> concurrent.futures.Future[Settled]:
        """``spill`` from any thread (the engine's own): the clones are made here, the item is queued on the loop.
        Settled cancelled (``Closed``) if the loop never runs it: closed at the call, or ended before the item settled
        (``Handoffs.watching``; found in review: the engine waited for ever on a loop that had stopped without a close).

        ``behind``: the future of a droppable spill of the same tokens (and caches) made here earlier, a write-behind.
        While that one is queued it is kept in place of this spill (made not droppable if this one is not: never
        shed from then on), and while it is written or once stored it stands for it (a write of it, kept or written,
        that then fails, or that the write gate sheds as it is written, has this one written in its place, next);
        only if it ended not stored otherwise (shed while queued, failed, cancelled) is this one queued
        (``SpillQueue.keep``). The future is then that spill's."""
        leased = not isinstance(self.lease, NoLease)
        item = new_item(self.identity, self.provider, tokens, caches, meta=meta, leased=leased, **kw)
        return self._handoffs.hand_over(self._bound(), item, behind, self.queue.enqueue, self.queue.keep)

    def barrier(self, key: str = "", *, action: Callable[[], Any] | None = None) -> asyncio.Future[Settled]:
        """A future that settles once every item queued before it has settled.

        In process, ``action`` (a function, or one that returns an awaitable) runs then, on the loop; its result is
        the ``Settled``'s value (e.g. delete something only once the writes before it are done).
        """

        async def run() -> Any:
            result = action() if action is not None else None
            return await result if isinstance(result, Awaitable) else result

        return self._submit(lambda: self.queue.enqueue(SpillItem(key=key, barrier=run)))

    async def cancel(self, *, namespace: str | None = None, key: str | None = None) -> int:
        """Cancel the queued items (not the one being written) of ``namespace`` and of ``key``; how many went."""
        which = matching(namespace, key)  # (named nothing: BadParams first, as on the clients)
        self._check_open()
        return self.queue.cancel_where(which)

    def _check_open(self) -> None:
        """``Closed`` once closed, as a closed client says it (found in review: a closed Spiller went on answering
        lookups and loads from a folder whose lock it had let go, and said its drains were done)."""
        if self._closed:
            raise errors.Closed("this Spiller is closed")

    def _bound(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise errors.NotStarted("the Spiller is not started: use 'await Spiller.open(...)' or 'async with'")
        return self._loop

    def _submit(self, enqueue: Callable[[], asyncio.Future[Settled]]) -> asyncio.Future[Settled]:
        return on_loop(self._bound(), enqueue)

    # --- reading ----------------------------------------------------------------------

    async def lookup(self, tokens: Sequence[int], namespace: str = "") -> api.Hit | Miss:
        """The longest usable prefix of ``tokens`` in the store (the file is not read)."""
        self._check_open()
        found = await self.store.lookup_async(self.identity, check_namespace(namespace), token_list(tokens))
        if isinstance(found, Miss):
            return found
        e = found.entry
        return api.Hit(e.path, found.matched, e.ntokens, e.trimmable, found.blocks_only)

    async def load(self, tokens: Sequence[int], namespace: str = "", *, longer_than: int = 0) -> Loaded | None:
        """Load the longest usable prefix of ``tokens``, cut to the matched length; None on a miss, or when the
        prefix holds at most ``longer_than`` tokens (the engine has that much in memory: not read, not a hit).
        A read that passes the store's I/O deadline (a hung disk) raises ``StorageTimeout``."""
        self._check_open()
        hit = await self.store.lookup_async(self.identity, check_namespace(namespace), token_list(tokens))
        if isinstance(hit, Miss) or hit.matched <= longer_than:
            return None
        ident = dataclasses.replace(self.identity, namespace=namespace)
        return await self._restore(hit, ident)

    async def _restore(self, hit: Hit, ident: fmt.Identity) -> Loaded | None:
        got = await self.store.restore_async(hit, ident)  # file I/O on worker threads, never on the engine's loop
        if isinstance(got, Miss) and got.reason is MissReason.IO_TIMEOUT:  # a hung disk: said, as the clients say it
            raise errors.StorageTimeout(f"a restore's read of {hit.entry.path} passed its deadline")
        return got if isinstance(got, Loaded) else None

    # --- generation checkpoints ----------------------------------------------------------

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoint: fmt.GenerationCheckpoint,
        *,
        attachments: Sequence[Attachment] = (),
    ) -> asyncio.Future[Settled]:
        """Checkpoint an in-flight generation (a ``spill`` with ``checkpoint``): it cancels the older checkpoints
        of the same key still queued, and is found by ``resume(key)``, never by a lookup."""
        return self.spill(tokens, caches, attachments=attachments, checkpoint=checkpoint)

    async def resume(self, key: str) -> Loaded | None:
        """Load the latest durable checkpoint of a generation, or None."""
        self._check_open()
        e = self.store.find_checkpoint(self.identity, key)
        if e is None:
            return None
        ident = dataclasses.replace(self.identity, namespace=checkpoint_namespace(key))
        return await self._restore(Hit(e, e.ntokens), ident)

    def finish(self, key: str) -> asyncio.Future[Settled]:
        """The generation is done: its queued work (checkpoints, and spills given ``key``) is cancelled, then its
        stored checkpoints deleted once the writes queued before this are settled; the ``Settled``'s value is how
        many were deleted."""

        def enqueue() -> asyncio.Future[Settled]:
            self.queue.cancel_where(of_generation(key))
            # the unlinks on a worker thread, as the daemon's barrier does: never on the engine's loop
            return self.queue.enqueue(SpillItem(key=key, barrier=lambda: self.store.remove_checkpoints_async(key)))

        return self._submit(enqueue)

    # --- lifecycle -----------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> DrainReport:
        """Wait until everything queued is settled (stored, dropped or failed), up to ``timeout``."""
        self._check_open()
        return await self.queue.drain(timeout)

    async def close(self, timeout: float | None = None) -> DrainReport:
        """Let the queue finish (up to ``timeout``), then stop taking spills and let the folder's lock go once the
        writer has ended. A second close gives the first one's report (found in review: it said done, nothing lost,
        after the first gave up). Found in review: a close cancelled during its drain let the lock go at once while
        the writer went on writing the items queued before it, into a folder another spilld could then own."""
        if self._close_report is not None:
            return self._close_report
        deadline = api.Deadline(timeout)
        try:
            self._close_report = await self.queue.close(deadline.left())
            await self._record_wear(deadline.left())
            return self._close_report
        except asyncio.CancelledError:
            # found in review: a close cancelled while it drained recorded none of the run's bytes, which the next
            # run's write budget then never counted. What was written so far is recorded before the cancel goes on
            await self._record_wear(deadline.within(CANCELLED_WEAR_S))
            raise
        finally:
            self._closed = True
            self.queue.after_writer(self._release)

    def _record(self) -> None:
        """Start adding the bytes written since the last record to the wear file (none: nothing to add)."""
        if self.store.wear.written:
            record = asyncio.ensure_future(self.store.record_wear())
            self._records.add(record)  # (held: a task nobody holds may be collected)
            record.add_done_callback(self._records.discard)

    async def _record_wear(self, wait_s: float | None) -> None:
        """Add the run's bytes to the wear file, waiting for that at most ``wait_s`` (the store's I/O deadline bounds
        the record itself). Past it the record goes on alone, never cancelled: a cancel waits for its thread, which a
        hung disk holds (found in review: ``close(timeout=1)`` took as long as the hung write of the wear file)."""
        self._record()
        if self._records:
            await asyncio.wait(self._records, timeout=wait_s)

    def _release(self) -> None:
        """The writer has ended: what it wrote after the close's record (a cancelled close's writer goes on with the
        items queued before it) is recorded too, on its own, and the folder's lock goes once every record has
        landed (``Store.record_wear``: before the lock goes; found in review, it went at once, and a spilld that
        took the folder meanwhile read a count without this run's bytes). Each record is bounded by the store's
        I/O deadline, and so is the wait."""
        self._record()
        if not self._records:
            self.store.close()
            return
        # (the wait is held by the records it waits on, which ``_records`` holds)
        asyncio.ensure_future(asyncio.wait(set(self._records))).add_done_callback(lambda _: self.store.close())

    async def status(self) -> dict[str, Any]:
        """The queue's and the store's counters, as the daemon's ``status`` has them under ``queue`` and ``store``."""
        self._check_open()
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """``status``, synchronously (in process only)."""
        return {"queue": self.queue.counters(), "store": self.store.stats()}
