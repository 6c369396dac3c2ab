"""A spill's snapshot, made on the engine's thread: the item the queue holds, its plan, what it counts.

Shared by the two ways of writing behind, ``Spiller`` (in-process) and ``AsyncClient`` (through the daemon): the
item is cut at the ``spill()`` call on the caller's thread, planned there or by the writer, and handed to an
event loop with ``on_loop`` (an ``asyncio.Future``) or ``threadsafe`` (a ``concurrent.futures.Future``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors, mlxthreads
from . import format as fmt
from .codecs import CodecProvider
from .entries import check_namespace, checkpoint_namespace
from .queue import Settled, SpillItem, held_bytes
from .saver import (
    AnySource,
    Attachment,
    clone_and_size,
    clone_attachments,
    encode_now,
    finish_plan,
    plan,
    token_ids_now,
)

Plan = tuple[fmt.Header, list[AnySource]]
AnyFuture = concurrent.futures.Future[Settled] | asyncio.Future[Settled]  # a spill's, from any way in

LOOP_WATCH_S = 0.1  # how often the hand-offs to a loop its caller runs look whether it still does (``watching``)
NOT_RUNNING = "the event loop this spill was handed to is not running (stopped, its thread ended, or closed)"


@dataclass(eq=False)
class Snapshot:
    """What an engine-side spill item carries besides its caches (``SpillItem.payload``)."""

    held: int = 0  # bytes its clones pin
    plan: Callable[[], Plan] | None = None  # a clone's plan, made by the writer (off the engine's thread)
    planned: Plan | None = None  # the plan once made
    live: bool = False  # a live snapshot: it pins no memory, its pending write counts instead
    # AsyncClient: the outcome of a write-behind of the same entry shipped already, which stands for this spill if the
    # daemon stores it (the ship waits for it, and sends this one only if it ended otherwise)
    leans_on: asyncio.Future[Settled] | None = None


def snapshot_of(item: SpillItem) -> Snapshot:
    """The item's snapshot (an empty one for a barrier, which has none)."""
    if item.payload is None:
        item.payload = Snapshot()
    if not isinstance(item.payload, Snapshot):
        raise TypeError(f"not an engine-side spill item: {type(item.payload).__name__}")
    return item.payload


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
    pin: bool = False,
    attachments: Sequence[Attachment] = (),
    checkpoint: fmt.GenerationCheckpoint | None = None,
    live: bool = False,
    leased: bool = True,
) -> SpillItem:
    """A planned spill item, made on the caller's (engine's) thread at the snapshot point.

    Everything the engine handed over is evaluated or copied here, on its own
    thread (mlx evaluates a graph only on the thread that built it): token ids
    become ints, attachments and caches become evaluated views (cheap clones),
    a ``live`` snapshot records each cache's offset and evaluates its buffers
    (the entries and header are planned later, by the writer). ``live`` reads append-only buffers at
    write time, inside the lease; without one (``leased=False``) nothing keeps
    the engine out while they are read, so the caches are cloned instead.
    """
    if len(caches) == 0:  # (found in review: stored, then a load handed the engine no caches for all its tokens)
        raise errors.BadParams("a spill needs the caches that hold its tokens: the list of caches is empty")
    # as it is now: a checkpoint is mutable, and an engine moves its next token on (found in review: the file held
    # the values at the write, or failed as inconsistent)
    checkpoint = dataclasses.replace(checkpoint) if checkpoint else None
    ns = checkpoint_namespace(checkpoint.key) if checkpoint else check_namespace(namespace)
    ident = dataclasses.replace(identity, namespace=ns)
    meta = dict(meta) if meta else None  # the caller's dict as it is now: the header is built later
    live = live and leased
    tokens = token_ids_now(tokens)
    if len(tokens) == 0:  # (found in review: stored as a file that no lookup can ever use)
        raise errors.BadParams("a spill needs at least one token: the token list is empty")
    item = SpillItem(
        tokens=tokens,
        attachments=clone_attachments(attachments),
        namespace=ns,
        key=key or (checkpoint.key if checkpoint else ""),
        droppable=droppable,
        pin=pin,
    )
    held = 0
    if not live:
        item.caches, held = clone_and_size(caches, provider)
    snap = item.payload = Snapshot(held=held)
    if live:  # read the caches now, at the snapshot point; the header is built by the writer, off this thread
        enc = encode_now(caches, attachments=item.attachments, provider=provider, live=True)
        snap.live = True
        snap.plan = functools.partial(finish_plan, enc, item.tokens, meta=meta, identity=ident, checkpoint=checkpoint)
    else:  # clones are planned whole by the writer
        snap.plan = functools.partial(
            plan, item.tokens, item.caches, meta=meta, identity=ident,
            attachments=item.attachments, checkpoint=checkpoint, provider=provider,
        )  # fmt: skip
    return item


def planned(item: SpillItem) -> tuple[fmt.Header, list[AnySource]]:
    """The item's header and sources, planning it now if that was deferred."""
    snap = snapshot_of(item)
    if snap.planned is None:
        if snap.plan is None:
            raise RuntimeError("a spill item without a plan (already shipped?)")
        snap.planned, snap.plan = snap.plan(), None
    return snap.planned


def item_bytes(item: SpillItem, provider: CodecProvider) -> int:
    """What an item counts against a queue cap: the memory it pins, or a live snapshot's pending write."""
    snap = snapshot_of(item)
    if snap.live:  # a live snapshot pins no memory: count its pending write (planned now, on the writer's loop)
        return sum(s.nbytes for s in planned(item)[0].slots())
    return snap.held + held_bytes([], item.attachments, provider)


def _running() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def on_loop(loop: asyncio.AbstractEventLoop, enqueue: Callable[[], asyncio.Future[Settled]]) -> asyncio.Future[Settled]:
    """Run ``enqueue`` now; the caller must be on ``loop``'s thread (an asyncio future is bound to its loop)."""
    if _running() is not loop:
        raise RuntimeError("spill() runs on the event loop's thread; from another thread call spill_threadsafe()")
    return enqueue()


def threadsafe(
    loop: asyncio.AbstractEventLoop, enqueue: Callable[[], asyncio.Future[Settled]]
) -> concurrent.futures.Future[Settled]:
    """Run ``enqueue`` on ``loop`` from any thread; a concurrent future of its outcome. A closed loop (it would never
    run it) settles it cancelled at once, as a closed queue's item; one that does not run now is left to a
    ``Handoffs.watching`` of it (not running may be not running yet: between ``run_until_complete`` and
    ``run_forever``, say)."""
    out: concurrent.futures.Future[Settled] = concurrent.futures.Future()

    def settle(f: asyncio.Future[Settled]) -> None:
        _settle(out, f.result())  # (a caller that cancelled it gave up the answer; the item goes on regardless)

    def run() -> None:
        if out.done() and not out.cancelled():  # settled cancelled while the loop stood (``Handoffs``): never queued
            return
        enqueue().add_done_callback(settle)

    if _running() is loop:
        run()
        return out
    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # a closed loop (a close won the race, or it had ended: found in review, waited for ever)
        settle_closed(out, NOT_RUNNING)
    return out


def _settle(fut: concurrent.futures.Future[Settled], result: Settled) -> None:
    """Settle ``fut`` with ``result`` unless it is settled or its caller cancelled it; from any thread (a loop run
    again after a ``Handoffs`` watch settled its hand-offs settles them too: ignored, and never logged as a future
    in an unexpected state)."""
    if fut.done():
        return
    with contextlib.suppress(RuntimeError, concurrent.futures.InvalidStateError):  # (the other one came first)
        if fut.set_running_or_notify_cancel():
            fut.set_result(result)


def same_spill(prior: SpillItem, item: SpillItem) -> bool:
    """Whether ``prior`` may stand for ``item``: the same tokens in the same namespace, and no pin or checkpoint that
    only ``item`` would write."""
    same = prior.namespace == item.namespace and prior.pin >= item.pin and not item.is_checkpoint
    return same and len(prior.tokens) == len(item.tokens) and np.array_equal(prior.tokens, item.tokens)


def settle_closed(fut: concurrent.futures.Future[Settled], why: str = "") -> None:
    """Settle ``fut`` as a closed queue's item (``why``: said in its error), unless it is settled or its caller
    cancelled it."""
    _settle(fut, Settled.closed(why) if why else Settled.closed())


class Handoffs:
    """The futures of spills handed to a loop from other threads (``threadsafe``) and not settled yet.

    A loop that stops before it runs a hand-off (a close racing the spill: it passed the closed check, then the
    loop stopped) never settles it; once that loop is closed, ``abandon`` settles each as a closed queue's item,
    and any tracked after, at once. Its caller is never left waiting.
    """

    def __init__(self, watch: asyncio.AbstractEventLoop | None = None) -> None:
        self._lock = threading.Lock()
        self._open: set[concurrent.futures.Future[Settled]] = set()
        self._abandoned = False
        self._watch = watch  # a loop whose end no hook tells of (``watching``)
        self._watching = False  # a thread watches it now
        self._runner = threading.current_thread()  # the thread last seen running that loop (``watching``)
        # droppable items by the future handed out for each: what a later spill's ``behind`` names (``prior``)
        self._items: weakref.WeakKeyDictionary[AnyFuture, SpillItem] = weakref.WeakKeyDictionary()

    @classmethod
    def watching(cls, loop: asyncio.AbstractEventLoop) -> Handoffs:
        """The hand-offs to a loop its caller runs (a ``Spiller``'s), made on that loop, whose stop or close nothing
        tells of: while any is open a thread looks every ``LOOP_WATCH_S`` whether the loop has ended (closed, or not
        running and the thread last seen running it gone), and then settles them cancelled (found in review: an
        engine's spill handed over as the loop stopped waited for ever). A loop that does not run while the thread
        that ran it lives may run again (``run_until_complete`` then ``run_forever``): its hand-offs wait."""
        return cls(watch=loop)

    @classmethod
    def closed_by(cls, on_close: Callable[[Callable[[], None]], None]) -> Handoffs:
        """The hand-offs to a loop whose closing calls the hooks ``on_close`` registers (``LoopThread.on_close``):
        abandoned then."""
        out = cls()
        on_close(out.abandon)
        return out

    def track(
        self, fut: concurrent.futures.Future[Settled], item: SpillItem | None = None
    ) -> concurrent.futures.Future[Settled]:
        """Follow ``fut`` until it settles; ``item``, the droppable spill it is the outcome of, is remembered for a
        later spill of the same entry that names ``fut`` as its ``behind`` (``prior``)."""
        if item is not None:
            self._remember(fut, item)
        if fut.done():  # (refused at once, or settled already: nothing to wait for)
            return fut
        with self._lock:
            tracked = not self._abandoned
            if tracked:
                self._open.add(fut)
            watch = tracked and self._watch is not None and not self._watching
            self._watching = self._watching or watch
        if watch:
            mlxthreads.start_thread(self._look, "spilld-loop-watch", daemon=True)
        if tracked:  # (outside the lock: a settled future runs the callback here, and it takes the lock)
            fut.add_done_callback(self._forget)
        else:
            settle_closed(fut)
        return fut

    def hand_over(
        self,
        loop: asyncio.AbstractEventLoop,
        item: SpillItem,
        behind: concurrent.futures.Future[Settled] | None,
        enqueue: Callable[[SpillItem], asyncio.Future[Settled]],
        keep: Callable[[SpillItem, SpillItem], asyncio.Future[Settled]],
    ) -> concurrent.futures.Future[Settled]:
        """``item`` handed to ``loop`` from any thread (``threadsafe``) and tracked: ``keep(item, prior)`` where the
        earlier droppable spill ``behind`` names may stand for it (``prior``), else ``enqueue(item)``, remembered
        for a later spill that names this one."""
        if (prior := self.prior(behind, item)) is not None:
            return self.track(threadsafe(loop, lambda: keep(item, prior)))
        return self.track(threadsafe(loop, lambda: enqueue(item)), item)

    def hand_over_here(
        self,
        loop: asyncio.AbstractEventLoop,
        item: SpillItem,
        behind: AnyFuture | None,
        enqueue: Callable[[SpillItem], asyncio.Future[Settled]],
        keep: Callable[[SpillItem, SpillItem], asyncio.Future[Settled]],
    ) -> asyncio.Future[Settled]:
        """``hand_over`` on ``loop``'s own thread (``on_loop``): the asyncio future, remembered as ``track`` remembers
        a droppable spill's."""
        if (prior := self.prior(behind, item)) is not None:
            return on_loop(loop, lambda: keep(item, prior))
        fut = on_loop(loop, lambda: enqueue(item))
        self._remember(fut, item)
        return fut

    def _remember(self, fut: AnyFuture, item: SpillItem) -> None:
        """A droppable spill by its future, for a later spill that names it as its ``behind`` (``prior``)."""
        if item.droppable:
            with self._lock:
                self._items[fut] = item

    def _look(self) -> None:
        """The watch's thread: it ends once no hand-off is open, or once the loop has ended (``watching``), having
        settled those that were (their callbacks run here). Each look at a running loop learns which thread runs it."""
        loop = self._watch
        assert loop is not None
        left: list[concurrent.futures.Future[Settled]] = []
        while True:
            time.sleep(LOOP_WATCH_S)
            stopped = loop.is_closed() or (not loop.is_running() and not self._runner.is_alive())
            if not stopped:
                with contextlib.suppress(RuntimeError):  # (closed meanwhile: seen at the next look)
                    loop.call_soon_threadsafe(self._seen_running)
            with self._lock:
                if stopped or not self._open:
                    if stopped:
                        left, self._open = list(self._open), set()
                    self._watching = False
                    break
        for fut in left:
            settle_closed(fut, NOT_RUNNING)

    def prior(self, behind: AnyFuture | None, item: SpillItem) -> SpillItem | None:
        """The droppable spill whose future is ``behind``, if it may stand for ``item`` (``same_spill``)."""
        if behind is None:
            return None
        with self._lock:
            prior = self._items.get(behind)
        return prior if prior is not None and same_spill(prior, item) else None

    def _seen_running(self) -> None:
        self._runner = threading.current_thread()  # (on the loop: whichever thread runs it now)

    def _forget(self, fut: concurrent.futures.Future[Settled]) -> None:
        with self._lock:
            self._open.discard(fut)

    def abandon(self) -> None:
        """The loop is closed: settle what it never will (settled outside the lock: their callbacks take it)."""
        with self._lock:
            left, self._open, self._abandoned = list(self._open), set(), True
        for fut in left:
            settle_closed(fut)
