"""Embedded mode: a queue, a store and a lease for one engine in one process.

spiller = Spiller(folder, identity=spilld.identity(model, tokenizer), lease=ThreadLockLease(gen_lock))
await spiller.start()
spiller.spill(tokens, cache)                 # returns at once; written behind
loaded = await spiller.restore(tokens)       # longest usable prefix, or None
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import fileio
from . import format as fmt
from .codecs import CodecProvider, default_provider
from .lease import NoLease, RunStep, off_loop
from .loader import Loaded
from .queue import DrainReport, Settled, SpillItem, SpillQueue, held_bytes
from .saver import Attachment, Staging, clone_and_size, plan
from .store import Hit, Miss, Store, check_namespace, checkpoint_namespace

log = logging.getLogger("spilld.spiller")

DEFAULT_QUEUE_CAP = 2 * 1024**3


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
    ) -> None:
        self.identity = identity
        self.provider = provider or default_provider()
        self.store = Store(folder, disk_cap=disk_cap, durability=durability, provider=self.provider, verify=verify)
        self.lease: RunStep = lease or NoLease()
        self.write_in_lease = write_in_lease
        self.queue = SpillQueue(queue_cap, self._write, bytes_of=self._bytes_of)
        self._staging = Staging()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> Spiller:
        """Scan the folder (off the event loop) and bind to the running loop."""
        self._loop = asyncio.get_running_loop()
        await off_loop(self.store.scan)
        return self

    # --- writing --------------------------------------------------------------------

    def _bytes_of(self, item: SpillItem) -> int:
        planned = item.meta.get("planned")
        if planned is not None:
            return int(planned[0].data_bytes)  # a live snapshot pins no memory; count its pending write
        if "held" in item.meta:
            return int(item.meta["held"]) + held_bytes([], item.attachments, self.provider)
        return held_bytes(item.caches, item.attachments, self.provider)

    async def _write(self, item: SpillItem) -> Any:
        ident = fmt.Identity(**{**self.identity.to_wire(), "namespace": item.namespace})
        return await self.store.put(
            item.tokens,
            item.caches,
            ident,
            meta=item.meta.get("meta"),
            attachments=item.attachments,
            checkpoint=item.meta.get("checkpoint"),
            run_step=self.lease,
            write_in_lease=self.write_in_lease,
            planned=item.meta.get("planned"),
            staging=self._staging,
        )

    def _item(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None,
        namespace: str,
        key: str,
        droppable: bool,
        attachments: Sequence[Attachment],
        checkpoint: fmt.GenerationCheckpoint | None,
        clone: bool,
        live: bool = False,
    ) -> SpillItem:
        ns = checkpoint_namespace(checkpoint.key) if checkpoint else check_namespace(namespace)
        item = SpillItem(
            tokens=list(tokens),
            attachments=list(attachments),
            namespace=ns,
            key=key or (checkpoint.key if checkpoint else ""),
            droppable=droppable,
            meta={"meta": meta, "checkpoint": checkpoint},
        )
        if live:
            # Planned now, on the engine's thread, at the snapshot point; rows are read under the lease later.
            ident = fmt.Identity(**{**self.identity.to_wire(), "namespace": ns})
            item.meta["planned"] = plan(
                tokens,
                caches,
                meta=meta,
                identity=ident,
                attachments=attachments,
                checkpoint=checkpoint,
                provider=self.provider,
                live=True,
            )
        else:
            # Clone on the caller's (engine's) thread: views are evaluated there, cheaply.
            if clone:
                item.caches, item.meta["held"] = clone_and_size(caches, self.provider)
            else:
                item.caches = list(caches)
        return item

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
        clone: bool = True,
        live: bool = False,
    ) -> asyncio.Future[Settled] | concurrent.futures.Future[Settled]:
        """Clone the caches, queue them and return at once with a future of the outcome.

        Call from the event loop thread (an ``asyncio.Future``) or from the
        engine's own thread (a ``concurrent.futures.Future``).

        ``live=True`` is for caches the engine keeps extending (a write-behind
        snapshot): instead of views (which make the engine's next in-place
        update copy the whole buffer), append-only buffers are read at write
        time, one tensor per lease step, and copied out inside the lease. The
        engine must not cut such a cache below its current length until the
        future settles (a cut is detected and fails the write).
        """
        item = self._item(tokens, caches, meta, namespace, key, droppable, attachments, checkpoint, clone, live)
        return self._submit(lambda: self.queue.enqueue(item))

    def barrier(
        self, key: str, action: Callable[[], Any]
    ) -> asyncio.Future[Settled] | concurrent.futures.Future[Settled]:
        """Run ``action`` after every write queued before it (e.g. delete a finished generation's checkpoint)."""

        async def run() -> Any:
            result = action()
            return await result if isinstance(result, Awaitable) else result

        return self._submit(lambda: self.queue.enqueue(SpillItem(key=key, barrier=run)))

    def _submit(self, enqueue: Callable[[], asyncio.Future[Settled]]) -> Any:
        loop = self._loop
        if loop is None:
            raise RuntimeError("Spiller.start() has not run")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return enqueue()
        out: concurrent.futures.Future[Settled] = concurrent.futures.Future()

        def on_loop() -> None:
            fut = enqueue()
            fut.add_done_callback(lambda f: out.set_result(f.result()))

        loop.call_soon_threadsafe(on_loop)
        return out

    # --- reading ----------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit | Miss:
        return self.store.lookup(self.identity, check_namespace(namespace), tokens)

    async def restore(self, tokens: Sequence[int], namespace: str = "") -> Loaded | None:
        """Load the longest usable prefix of ``tokens``, cut to the matched length; None on a miss."""
        hit = self.lookup(tokens, namespace)
        if isinstance(hit, Miss):
            return None
        ident = fmt.Identity(**{**self.identity.to_wire(), "namespace": namespace})
        got = await off_loop(lambda: self.store.restore(hit, ident))
        return got if isinstance(got, Loaded) else None

    # --- generation checkpoints ----------------------------------------------------------

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoint: fmt.GenerationCheckpoint,
        *,
        attachments: Sequence[Attachment] = (),
    ) -> asyncio.Future[Settled] | concurrent.futures.Future[Settled]:
        """Checkpoint an in-flight generation; a newer one for the same key cancels older queued ones."""

        def enqueue() -> asyncio.Future[Settled]:
            self.queue.cancel_where(lambda it: it.key == checkpoint.key)
            return self.queue.enqueue(item)

        item = self._item(tokens, caches, None, "", checkpoint.key, True, attachments, checkpoint, True)
        return self._submit(enqueue)

    async def resume(self, key: str) -> Loaded | None:
        """Load the latest durable checkpoint of a generation, or None."""
        e = self.store.find_checkpoint(self.identity, key)
        if e is None:
            return None
        ident = fmt.Identity(**{**self.identity.to_wire(), "namespace": checkpoint_namespace(key)})
        got = await off_loop(lambda: self.store.restore(Hit(e, e.ntokens), ident))
        return got if isinstance(got, Loaded) else None

    def finish(self, key: str) -> asyncio.Future[Settled] | concurrent.futures.Future[Settled]:
        """The generation is done: drop its queued checkpoints, then delete the stored ones after in-flight writes."""

        def enqueue() -> asyncio.Future[Settled]:
            self.queue.cancel_where(lambda it: it.key == key)
            return self.queue.enqueue(
                SpillItem(key=key, barrier=lambda: off_loop(lambda: self.store.remove_checkpoints(key)))
            )

        return self._submit(enqueue)

    # --- lifecycle -----------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> DrainReport:
        return await self.queue.drain(timeout)

    async def close(self, timeout: float | None = None) -> DrainReport:
        return await self.queue.close(timeout)

    def stats(self) -> dict[str, Any]:
        return {"queue": self.queue.counters(), "store": self.store.stats()}
