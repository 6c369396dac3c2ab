"""SpillQueue: a bounded, ordered write-behind queue of cache clones.

One store runs at a time, in enqueue order, so a barrier runs after everything
queued before it. A soft byte cap sheds the oldest droppable items that are not
in flight. A generation's checkpoint makes the older ones of that generation still
queued moot: they are cancelled as it is queued. Every enqueue returns a future that never raises: it settles with an
``Outcome`` once the item is stored, dropped, cancelled or failed. Clones are
released exactly once on every path, and a release that raises is isolated to
its item.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import errors
from .entries import CHECKPOINT_NS_PREFIX, checkpoint_namespace

if TYPE_CHECKING:
    from .codecs import CodecProvider

log = logging.getLogger("spilld.queue")

# How long close waits for the writer it cancelled, within its timeout (a step stuck in a thread is left behind),
# and at least a few loop turns, past it: a writer that is not stuck unwinds before close returns
CLOSE_STOP_S = 1.0
CLOSE_STOP_MIN_S = 0.05
DEFAULT_QUEUE_CAP = 2 * 1024**3  # a caller's queue of spills not yet written (Spiller) or shipped (the clients)


class Outcome(enum.Enum):
    STORED = "stored"  # durable: the file is on disk and indexed
    DROPPED = "dropped"
    CANCELLED = "cancelled"
    FAILED = "failed"
    SHIPPED = "shipped"  # a client's local queue only: handed to the daemon, whose answer settles the spill


@dataclass
class Settled:
    """How an item ended. ``value`` is what the store returned; ``error`` why it failed."""

    outcome: Outcome
    value: Any = None
    error: BaseException | None = None

    @property
    def stored(self) -> bool:
        return self.outcome is Outcome.STORED

    @classmethod
    def closed(cls, why: str = "queue is closed") -> Settled:
        """What a closed queue (or a client closed, or closing) answers an item with."""
        return cls(Outcome.CANCELLED, error=errors.Closed(why))


@dataclass(eq=False)
class SpillItem:
    """What the queue holds: tokens plus owned cache clones (or a barrier action)."""

    tokens: Sequence[int] = ()
    caches: list[Any] = field(default_factory=list)
    attachments: list[Any] = field(default_factory=list)
    namespace: str = ""
    key: str = ""
    droppable: bool = True
    pin: bool = False  # once stored, evicted last and never superseded (a shared system prompt)
    barrier: Callable[[], Awaitable[Any]] | None = None  # runs instead of a store
    payload: Any = None  # the writer's own: a snapshot.Snapshot engine-side, a daemon.connection.Received there
    nbytes: int = 0
    seq: int = 0
    ended: Settled | None = None  # how it settled, once it has (what ``SpillQueue.keep`` asks of an earlier item)

    @property
    def is_barrier(self) -> bool:
        return self.barrier is not None

    @property
    def is_checkpoint(self) -> bool:
        return self.namespace.startswith(CHECKPOINT_NS_PREFIX)


def matching(namespace: str | None = None, key: str | None = None) -> Callable[[SpillItem], bool]:
    """Items of ``namespace`` and of ``key`` (None: any): what a ``cancel`` call names; one of them at least."""
    if namespace is None and key is None:
        raise errors.BadParams("cancel needs a namespace or a key")
    return lambda it: (namespace is None or it.namespace == namespace) and (key is None or it.key == key)


def of_generation(key: str) -> Callable[[SpillItem], bool]:
    """A generation's queued work, moot once it is finished: its checkpoints, and spills given its key."""
    ns = checkpoint_namespace(key)
    return lambda it: it.namespace == ns or (key != "" and it.key == key)


def held_bytes(caches: Sequence[Any], attachments: Sequence[Any] = (), provider: CodecProvider | None = None) -> int:
    """Memory an item pins: every distinct buffer its clones and attachments hold."""
    import mlx.core as mx  # engine side: the daemon's queue counts bytes it received, never mlx arrays

    from .codecs import default_provider
    from .codecs.base import Source

    p = provider or default_provider()
    seen: dict[int, int] = {}
    for c in caches:
        for s in p.encode(c).sources:
            if isinstance(s, Source):
                seen[id(s.array)] = s.array.nbytes
    for a in attachments:
        for t in getattr(a, "tensors", ()):
            if isinstance(t, mx.array):
                seen[id(t)] = t.nbytes
    return sum(seen.values())


def unpin(exc: BaseException) -> None:
    """Drop the tracebacks an error holds (its causes' too), and with them the frames they keep alive.

    A failed item's error outlives the item (in its ``Settled``, in a caller's hands); its traceback's
    frames would otherwise pin the item's clones or received bytes (and, through an asyncio future in
    one of them, form a cycle only the garbage collector breaks). The frames are let go, never cleared:
    one may belong to a coroutine that is only suspended, and clearing it would finalize that coroutine.
    """
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


@dataclass
class DrainReport:
    """A drain's end: ``done`` when everything queued before it settled; ``not_stored``: how many of those
    settled otherwise (dropped, failed or cancelled: not durable, whatever ``done`` says)."""

    done: bool
    pending_items: int
    pending_bytes: int
    not_stored: int = 0


def _follow(out: asyncio.Future[Settled], settled: asyncio.Future[Settled]) -> None:
    """Settle ``out`` as ``settled`` did (unless its caller cancelled it)."""
    if not out.done():
        out.set_result(settled.result())


def _durable(outcome: Outcome) -> bool:
    return outcome in (Outcome.STORED, Outcome.SHIPPED)  # (a client's local queue: handed to the daemon)


@dataclass
class _Rec:
    item: SpillItem
    future: asyncio.Future[Settled]  # the caller's: it may cancel it
    settled: asyncio.Future[Settled]  # the queue's own, which drain waits on: only _finish sets it
    released: bool = False
    stand_in: SpillItem | None = None  # a later spill of what the item holds, held until it ends (``keep``)


StoreFn = Callable[[SpillItem], Awaitable[Any]]


class SpillQueue:
    """A soft-capped FIFO of spill items with a single writer task."""

    def __init__(
        self,
        cap_bytes: int,
        store: StoreFn,
        *,
        release: Callable[[SpillItem], None] | None = None,
        bytes_of: Callable[[SpillItem], int] | None = None,
        done: Outcome = Outcome.STORED,
    ) -> None:
        """``done``: the outcome of an item its store function finished (``SHIPPED`` for a client's queue)."""
        if cap_bytes < 0:
            raise ValueError("cap_bytes must be >= 0")
        self.cap_bytes = cap_bytes
        self._store = store
        self._done = done
        self._release_hook = release
        self._bytes_of = bytes_of or (lambda it: held_bytes(it.caches, it.attachments))
        self._queue: deque[_Rec] = deque()
        self._in_flight: _Rec | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._seq = itertools.count(1)
        self._closed = False
        self.pending_bytes = 0
        self.stored = 0
        self.dropped = 0
        self.cancelled = 0
        self.failed = 0
        self.barriers = 0  # settled, whatever their outcome: never among the items' outcomes above
        self.release_errors = 0
        self.bytes_written = 0
        self.peak_bytes = 0

    # --- counters -----------------------------------------------------------

    @property
    def pending_items(self) -> int:
        return len(self._queue) + (self._in_flight is not None)

    def counters(self) -> dict[str, int]:
        return {
            "pending_items": self.pending_items,
            "pending_bytes": self.pending_bytes,
            "peak_bytes": self.peak_bytes,
            "stored": self.stored,
            "dropped": self.dropped,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "barriers": self.barriers,
            "release_errors": self.release_errors,
            "bytes_written": self.bytes_written,
        }

    # --- enqueue and shedding -------------------------------------------------

    def enqueue(self, item: SpillItem) -> asyncio.Future[Settled]:
        """Queue an item (ownership of its clones passes to the queue). Never raises for the item's sake."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Settled] = loop.create_future()
        rec = _Rec(item, fut, loop.create_future())
        self._unless_stopped_from_outside()
        if self._closed:
            self._finish(rec, Settled.closed())
            return fut
        item.seq = next(self._seq)
        if item.is_barrier:
            item.droppable = False
        try:
            item.nbytes = self._bytes_of(item)
        except Exception as exc:  # an item we cannot even size fails alone (an older checkpoint is kept: review)
            self._finish(rec, Settled(Outcome.FAILED, error=exc))
            return fut
        if item.is_checkpoint:  # the generation has moved on: its older checkpoints still queued are moot
            self.cancel_where(lambda it: it.namespace == item.namespace)
        self._queue.append(rec)
        self.pending_bytes += item.nbytes
        if item.nbytes:  # an item of no bytes (a barrier) puts nothing over the cap (found in review: a barrier
            self._shed(keep=rec)  # shed the spill queued just before it, the one it was meant to wait for)
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)
        self._kick(loop)
        return fut

    def _unless_stopped_from_outside(self) -> None:
        """Close the queue if its writer was cancelled, and not by ``close``: its loop is winding down
        (``asyncio.run`` cancels every task, then shuts its threads down). It takes nothing more, and what waits in
        it is cancelled (found in review: the next spill started a new writer, whose first step failed with a plain
        RuntimeError from the executor already shut down). A ``close`` under way too (``asyncio.run`` cancels a
        task closing the queue with the writer) has nothing left to wait for: what waits is cancelled all the same
        (``close`` cancels what is left before it cancels the writer itself, so then nothing is)."""
        if self._worker is not None and self._worker.cancelled():
            self._closed = True
            self.cancel_where(lambda _: True, barriers=True)

    def _writer_ended(self, worker: asyncio.Task[None]) -> None:
        """The writer's end, however it came: cancelled from outside, what waits is cancelled now, never left for a
        next spill that may not come (found in review: a drain, or a close with no timeout, waited for ever on
        items no writer would settle, and ``asyncio.run`` ending with such a close in a task never returned)."""
        if worker is self._worker:
            self._unless_stopped_from_outside()

    def keep(self, item: SpillItem, behind: SpillItem) -> asyncio.Future[Settled]:
        """Queue ``item``, a later spill of what ``behind`` (an earlier item of this queue) holds, only where
        ``behind`` cannot stand for it; the future of whichever does.

        ``behind`` still queued stands for it: promoted, made not droppable if ``item`` is not (from then on never
        shed, and counted against the cap as the items that may not be dropped are), where it stands in the queue
        (its place is its first enqueue's). ``behind`` being written stands for it too. Either way ``item`` is held,
        never queued, until ``behind`` ends, and is written in its place, next, if ``behind``'s write fails (found
        in review: an entry mlx-lm's LRU evicted while its write-behind was queued, or written, was lost when that
        write failed; one that failed before the eviction is spilled again); else it is let go. ``behind`` stored
        stands for it as well (``item`` is let go). ``behind`` shed, failed or cancelled (or never queued): ``item``
        is queued. The check and the promotion are one step on the loop: neither the writer taking ``behind`` nor a
        shed of it can come between them (found in review: an entry mlx-lm's LRU evicted while its write-behind was
        queued was spilled again, and both were written)."""
        settled = self.promote(behind, item.droppable, stand_in=item)
        written = self._in_flight if self._in_flight is not None and self._in_flight.item is behind else None
        if settled is None and written is not None:
            # being written: its store may still fail it, or shed it (a Spiller's write gate, ``admit_after``,
            # judges it once its bytes are taken); either way the writer then writes ``item`` instead
            # (``_write_instead``)
            settled = written.settled
            self._hold(written, item)
        if settled is None and (behind.ended is None or not _durable(behind.ended.outcome)):
            return self.enqueue(item)
        out: asyncio.Future[Settled] = asyncio.get_running_loop().create_future()
        if settled is None:  # stored already
            assert behind.ended is not None
            self.let_go(item)
            out.set_result(behind.ended)
            return out
        settled.add_done_callback(lambda s: _follow(out, s))
        return out

    def promote(
        self, behind: SpillItem, droppable: bool, *, stand_in: SpillItem | None = None
    ) -> asyncio.Future[Settled] | None:
        """``behind`` still queued: made not droppable unless ``droppable`` (never shed from then on, counted
        against the cap as the items that may not be dropped are), where it stands; the future of its settling.
        None if it is not queued (being written, or ended). ``stand_in``, a later spill of what ``behind`` holds, is
        then held until ``behind`` ends and written in its place if its write fails (``_write_instead``)."""
        self._unless_stopped_from_outside()
        rec = next((r for r in self._queue if r.item is behind), None)
        if rec is None:
            return None
        if not droppable:
            rec.item.droppable = False
        if stand_in is not None:
            self._hold(rec, stand_in)
        return rec.settled

    def holds_stand_in(self, item: SpillItem) -> bool:
        """Whether ``item``, being written, holds a later spill it stands for (``keep``, ``promote``): a store that
        can learn of a failure after its write returned (a client's ship) waits for that answer first."""
        rec = self._in_flight
        return rec is not None and rec.item is item and rec.stand_in is not None

    def _hold(self, rec: _Rec, stand_in: SpillItem) -> None:
        """Hold ``stand_in`` on ``rec`` until it ends (``_write_instead``); let go if ``rec`` holds one already."""
        if rec.stand_in is None:
            rec.stand_in = stand_in
        else:
            self.let_go(stand_in)

    def let_go(self, item: SpillItem) -> None:
        """Let the clones of an item never queued go (one another item stands for: ``keep``)."""
        self._release(item)

    def _shed(self, keep: _Rec) -> None:
        while self.pending_bytes > self.cap_bytes:
            victim = next((r for r in self._queue if r is not keep and r.item.droppable), None)
            if victim is None:
                return  # nothing may go: the cap is soft
            self._queue.remove(victim)
            self._finish(victim, Settled(Outcome.DROPPED))

    def would_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the cap once every droppable queued item is shed."""
        sheddable = sum(r.item.nbytes for r in self._queue if r.item.droppable)
        return self.pending_bytes - sheddable + nbytes <= self.cap_bytes

    def cancel_where(self, pred: Callable[[SpillItem], bool], *, barriers: bool = False) -> int:
        """Drop queued (never in-flight) items matching ``pred``; barriers only when asked."""
        n = 0
        for rec in list(self._queue):
            if (barriers or not rec.item.is_barrier) and pred(rec.item):
                self._queue.remove(rec)
                self._finish(rec, Settled(Outcome.CANCELLED))
                n += 1
        return n

    # --- the writer -------------------------------------------------------------

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        self._wakeup.set()
        if self._worker is None or self._worker.done():
            if self._worker is not None and not self._worker.cancelled():
                self._worker.exception()  # (the one that ended it, settled in its item: retrieved, not logged)
            self._worker = loop.create_task(self._run(), name="spilld-queue-writer")
            self._worker.add_done_callback(self._writer_ended)

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._queue:
                self._wakeup.clear()
                if self._closed:
                    return
                await self._wakeup.wait()
                continue
            rec = self._queue.popleft()
            self._in_flight = rec
            try:
                item = rec.item
                value = await (item.barrier() if item.barrier is not None else self._store(item))
            except asyncio.CancelledError:
                self._finish(rec, Settled(Outcome.CANCELLED))
                if (me := asyncio.current_task()) is not None and me.cancelling():
                    raise  # close stops the writer
                # else a cancel from inside the item (a barrier's action awaited a cancelled future): that item
                # is cancelled, the writer goes on with the next
            except errors.Shed as exc:  # the store declined a droppable item (e.g. its write budget is spent)
                # a Spiller's store gates a write-behind once it has it (``--admit-after``, after the bytes are
                # taken): a later spill held on it (``keep``, an eviction's, not droppable) is written in its place,
                # as for a failed write (found in review: it was let go with it, the evicted entry lost)
                shed = Settled(Outcome.DROPPED, error=exc)
                if not self._write_instead(rec, shed):
                    self._finish(rec, shed)
            except Exception as exc:
                log.warning(
                    "spill of %d bytes (ns=%r key=%r) failed: %s",
                    rec.item.nbytes,
                    rec.item.namespace,
                    rec.item.key,
                    exc,
                )
                unpin(exc)
                failed = Settled(Outcome.FAILED, error=exc)
                if not self._write_instead(rec, failed):
                    self._finish(rec, failed)
            except GeneratorExit:  # the loop closed under the writer (its coroutine closed): nothing can be settled
                raise
            except BaseException as exc:  # (KeyboardInterrupt, SystemExit) the writer ends with it: its item fails
                self._finish(rec, Settled(Outcome.FAILED, error=exc))  # and those queued behind it are cancelled,
                self.cancel_where(lambda _: True, barriers=True)  # never left for a drain to wait on (review)
                raise
            else:
                self.bytes_written += int(getattr(value, "file_bytes", 0) or 0)
                self._finish(rec, Settled(self._done, value=value))
            finally:
                self._in_flight = None

    def _write_instead(self, rec: _Rec, failed: Settled) -> bool:
        """``rec``'s write failed, or its store shed it: the later spill it stood for (``keep``, ``promote``), if
        any, takes its place at the head of the queue and is written next (nothing awaits in between: no shed comes
        first); ``rec`` then settles, and is counted, once, as that one ends. Whether it did."""
        item, rec.stand_in = rec.stand_in, None
        if item is None:
            return False
        try:
            item.nbytes = self._bytes_of(item)
        except Exception:  # (it cannot be sized: it goes, and the failure stands)
            self._release(item)
            return False
        item.seq = rec.item.seq
        self.pending_bytes += item.nbytes - rec.item.nbytes
        rec.item.ended = failed
        self._release(rec.item)
        rec.item = item
        self._queue.appendleft(rec)
        return True

    def _finish(self, rec: _Rec, result: Settled) -> None:
        """Settle and release an item: exactly once, whatever the path."""
        if rec.released:
            return
        rec.released = True
        if rec.item.is_barrier:  # a barrier stores nothing (found in review: "stored" counted them)
            self.barriers += 1
        else:
            self._count(result.outcome)
        if rec.item.seq:
            self.pending_bytes -= rec.item.nbytes
        rec.item.ended = result
        self._release(rec.item)
        if rec.stand_in is not None:  # (its write stood for it: stored, or it ended otherwise, not failed)
            rec.stand_in.ended = result
            self._release(rec.stand_in)
        rec.settled.set_result(result)
        if not rec.future.done():  # (a caller that cancelled it gave up on the answer, not on the item)
            rec.future.set_result(result)

    def _release(self, item: SpillItem) -> None:
        """Let an item's clones go (an item settled, or one ``keep`` never queued)."""
        try:
            if self._release_hook is not None:
                self._release_hook(item)
        except Exception as exc:  # one bad release never stalls the queue
            self.release_errors += 1
            log.warning("releasing spill item %d failed: %s", item.seq, exc)
        finally:
            item.caches = []
            item.attachments = []
            item.payload = None  # planned sources and received bytes go with the clones

    def _count(self, outcome: Outcome) -> None:
        """Every item settles once, through ``_finish``: counted there, so the counters add up to what was queued."""
        if outcome in (Outcome.STORED, Outcome.SHIPPED):  # (a client's local queue: handed to the daemon)
            self.stored += 1
        elif outcome is Outcome.DROPPED:
            self.dropped += 1
        elif outcome is Outcome.FAILED:
            self.failed += 1
        else:
            self.cancelled += 1

    # --- drain and close --------------------------------------------------------

    def settling(self) -> list[asyncio.Future[Settled]]:
        """What ``drain`` waits for: the settling of everything enqueued now (never the callers' futures, which a
        caller may cancel)."""
        futs = [r.settled for r in self._queue]
        if self._in_flight is not None:
            futs.append(self._in_flight.settled)
        return futs

    async def drain(
        self, timeout: float | None = None, *, of: list[asyncio.Future[Settled]] | None = None
    ) -> DrainReport:
        """Wait until everything enqueued before this call (or in ``of``, a ``settling()`` taken earlier: a wait in
        slices) has settled, or ``timeout`` passes."""
        futs = self.settling() if of is None else of
        if futs:
            await asyncio.wait(futs, timeout=timeout)
        left = [f for f in futs if not f.done()]
        lost = sum(1 for f in futs if f.done() and not _durable(f.result().outcome))
        return DrainReport(not left, self.pending_items, self.pending_bytes, lost)

    def after_writer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the writer has ended (now if none runs): from then on nothing of this queue's is written.
        A close cancelled, or past its timeout with a step stuck in a thread, returns before the writer ends."""
        if self._worker is None or self._worker.done():
            fn()
        else:
            self._worker.add_done_callback(lambda _: fn())

    async def close(self, timeout: float | None = None) -> DrainReport:
        """Refuse new items, drain, then stop the writer; what is left at the timeout is cancelled. ``timeout``
        bounds the whole call."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + max(0.0, timeout)
        self._closed = True
        report = await self.drain(timeout)
        self.cancel_where(lambda _: True, barriers=True)
        if self._worker is not None:
            if self._wakeup is not None:
                self._wakeup.set()
            if report.done:
                await asyncio.gather(self._worker, return_exceptions=True)
            else:
                self._worker.cancel()
                # a step stuck in a thread (a hung disk, an engine's lock held) cannot be stopped: it is left to end
                # on its own (its item then settles cancelled), and close keeps to its timeout
                left = CLOSE_STOP_S if end is None else min(CLOSE_STOP_S, end - loop.time())
                await asyncio.wait([self._worker], timeout=max(CLOSE_STOP_MIN_S, left))
        return report
