"""Embedded mode: a queue, a store and a lease for one engine in one process.

spiller = Spiller(folder, identity=spilld.identity(model, tokenizer), lease=ThreadLockLease(gen_lock))
await spiller.start()
spiller.spill(tokens, cache)                 # returns at once; written behind
loaded = await spiller.restore(tokens)       # longest usable prefix, or None
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import errors, fileio
from . import format as fmt
from .codecs import CodecProvider, default_provider
from .lease import NoLease, RunStep, off_loop
from .loader import Loaded
from .queue import DrainReport, Settled, SpillItem, SpillQueue, held_bytes
from .saver import AnySource, Attachment, Staging, clone_and_size, clone_attachments, evaluated, plan, token_ids_now
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
        """Scan the folder (off the event loop), then bind to the running loop (spills wait for the scan)."""
        await off_loop(self.store.scan)
        self._loop = asyncio.get_running_loop()
        return self

    # --- writing --------------------------------------------------------------------

    def _bytes_of(self, item: SpillItem) -> int:
        return item_bytes(item, self.provider)

    async def _write(self, item: SpillItem) -> Any:
        return await self.store.put(
            [],
            [],
            self.identity,
            run_step=self.lease,
            write_in_lease=self.write_in_lease,
            planned=planned(item),
            staging=self._staging,
        )

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
        """
        item = new_item(
            self.identity, self.provider, tokens, caches, meta=meta, namespace=namespace, key=key,
            droppable=droppable, attachments=attachments, checkpoint=checkpoint, clone=clone, live=live,
            leased=not isinstance(self.lease, NoLease),
        )  # fmt: skip
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
        if self._loop is None:
            raise RuntimeError("Spiller.start() has not run")
        return submit(self._loop, enqueue)

    # --- reading ----------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit | Miss:
        return self.store.lookup(self.identity, check_namespace(namespace), tokens)

    async def restore(self, tokens: Sequence[int], namespace: str = "", *, longer_than: int = 0) -> Loaded | None:
        """Load the longest usable prefix of ``tokens``, cut to the matched length; None on a miss, or when the
        prefix holds at most ``longer_than`` tokens (the engine has that much in memory: not read, not a hit)."""
        hit = self.lookup(tokens, namespace)
        if isinstance(hit, Miss) or hit.matched <= longer_than:
            return None
        ident = fmt.Identity(**{**self.identity.to_wire(), "namespace": namespace})
        return await self._restore(hit, ident)

    async def _restore(self, hit: Hit, ident: fmt.Identity) -> Loaded | None:
        # The read runs on a worker thread; the index is only ever changed on the loop's thread.
        try:
            loaded: Loaded | errors.SpillError = await off_loop(lambda: self.store.read_hit(hit, ident))
        except errors.SpillError as exc:
            loaded = exc
        got = self.store.restore_done(hit, loaded)
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

        item = new_item(self.identity, self.provider, tokens, caches, attachments=attachments, checkpoint=checkpoint)
        return self._submit(enqueue)

    async def resume(self, key: str) -> Loaded | None:
        """Load the latest durable checkpoint of a generation, or None."""
        e = self.store.find_checkpoint(self.identity, key)
        if e is None:
            return None
        ident = fmt.Identity(**{**self.identity.to_wire(), "namespace": checkpoint_namespace(key)})
        return await self._restore(Hit(e, e.ntokens), ident)

    def finish(self, key: str) -> asyncio.Future[Settled] | concurrent.futures.Future[Settled]:
        """The generation is done: drop its queued checkpoints, then delete the stored ones after in-flight writes."""

        def enqueue() -> asyncio.Future[Settled]:
            self.queue.cancel_where(lambda it: it.key == key)
            return self.queue.enqueue(SpillItem(key=key, barrier=lambda: _now(self.store.remove_checkpoints, key)))

        return self._submit(enqueue)

    # --- lifecycle -----------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> DrainReport:
        return await self.queue.drain(timeout)

    async def close(self, timeout: float | None = None) -> DrainReport:
        return await self.queue.close(timeout)

    def stats(self) -> dict[str, Any]:
        return {"queue": self.queue.counters(), "store": self.store.stats()}


def new_item(
    identity: fmt.Identity,
    provider: CodecProvider,
    tokens: Sequence[int],
    caches: Sequence[Any],
    *,
    meta: dict[str, str] | None = None,
    namespace: str = "",
    key: str = "",
    droppable: bool = True,
    attachments: Sequence[Attachment] = (),
    checkpoint: fmt.GenerationCheckpoint | None = None,
    clone: bool = True,
    live: bool = False,
    leased: bool = True,
) -> SpillItem:
    """A planned spill item, made on the caller's (engine's) thread at the snapshot point.

    Everything the engine handed over is evaluated or copied here, on its own
    thread (mlx evaluates a graph only on the thread that built it): token ids
    become ints, attachments and caches become evaluated views (cheap clones),
    a ``live`` snapshot is planned now. ``live`` reads append-only buffers at
    write time, inside the lease; without one (``leased=False``) nothing keeps
    the engine out while they are read, so the caches are cloned instead.
    """
    ns = checkpoint_namespace(checkpoint.key) if checkpoint else check_namespace(namespace)
    ident = fmt.Identity(**{**identity.to_wire(), "namespace": ns})
    live = live and leased
    item = SpillItem(
        tokens=token_ids_now(tokens),
        attachments=clone_attachments(attachments),
        namespace=ns,
        key=key or (checkpoint.key if checkpoint else ""),
        droppable=droppable,
    )
    held = 0
    if not live:
        if clone:
            item.caches, held = clone_and_size(caches, provider)
        else:
            item.caches, held = evaluated(caches), held_bytes(caches, (), provider)
    item.meta["held"] = held
    make_plan = functools.partial(
        plan, item.tokens, item.caches if not live else caches, meta=meta, identity=ident,
        attachments=item.attachments, checkpoint=checkpoint, provider=provider, live=live,
    )  # fmt: skip
    # A live snapshot is planned now (its state is read here); clones are planned by the writer, off this thread.
    item.meta["planned" if live else "plan"] = make_plan() if live else make_plan
    return item


def planned(item: SpillItem) -> tuple[fmt.Header, list[AnySource]]:
    """The item's header and sources, planning it now if that was deferred."""
    if "planned" not in item.meta:
        item.meta["planned"] = item.meta.pop("plan")()
    result: tuple[fmt.Header, list[AnySource]] = item.meta["planned"]
    return result


def item_bytes(item: SpillItem, provider: CodecProvider) -> int:
    """What an item counts against a queue cap: the memory it pins, or a live snapshot's pending write."""
    if "planned" in item.meta:  # a live snapshot pins no memory: count its pending write
        return int(item.meta["planned"][0].data_bytes)
    return int(item.meta.get("held", 0)) + held_bytes([], item.attachments, provider)


def submit(loop: asyncio.AbstractEventLoop, enqueue: Callable[[], asyncio.Future[Settled]]) -> Any:
    """Run ``enqueue`` on ``loop``: directly from its own thread (an asyncio future), else thread-safely
    (a concurrent future)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return enqueue()
    out: concurrent.futures.Future[Settled] = concurrent.futures.Future()
    loop.call_soon_threadsafe(lambda: enqueue().add_done_callback(lambda f: out.set_result(f.result())))
    return out


async def _now(fn: Callable[..., Any], *args: Any) -> Any:
    """Run index work on the loop's thread (the store is not thread-safe), as an awaitable."""
    return fn(*args)
