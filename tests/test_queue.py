"""SpillQueue rules, including the seed's cases and failure isolation (asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from spilld import errors
from spilld.entries import checkpoint_namespace
from spilld.queue import Outcome, SpillItem, SpillQueue, matching, of_generation

pytestmark = pytest.mark.asyncio


class Recorder:
    """A store that records the order of writes, can be held open, and can fail on demand."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.fail: set[str] = set()
        self.shed: set[str] = set()  # declined as a store's write gate declines a droppable spill
        self.released: list[str] = []

    async def store(self, item: SpillItem) -> str:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if item.key in self.fail:
            raise OSError(28, "No space left on device")
        if item.key in self.shed and item.droppable:
            raise errors.NotAdmitted("not asked for yet")
        self.order.append(item.key)
        return item.key

    def release(self, item: SpillItem) -> None:
        self.released.append(item.key)


def item(key: str, nbytes: int = 10, droppable: bool = True, **kw: Any) -> SpillItem:
    return SpillItem(key=key, droppable=droppable, payload=nbytes, **kw)


def queue(rec: Recorder, cap: int = 1000, **kw: Any) -> SpillQueue:
    return SpillQueue(cap, rec.store, release=rec.release, bytes_of=lambda it: it.payload or 0, **kw)


async def test_stores_serially_in_enqueue_order_and_releases_once() -> None:
    rec = Recorder()
    q = queue(rec)
    futs = [q.enqueue(item(str(i))) for i in range(5)]
    results = await asyncio.gather(*futs)
    assert [r.outcome for r in results] == [Outcome.STORED] * 5
    assert rec.order == ["0", "1", "2", "3", "4"] and sorted(rec.released) == sorted(rec.order)
    assert (q.stored, q.pending_items, q.pending_bytes) == (5, 0, 0)


async def test_over_cap_drops_the_oldest_queued_not_in_flight_not_newest() -> None:
    # the seed's case: cap 100, items of 60 each -> [stored, dropped, stored]
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=100)
    a = q.enqueue(item("a", 60))
    await rec.started.wait()  # a is in flight now: not droppable
    b = q.enqueue(item("b", 60))
    c = q.enqueue(item("c", 60))  # over the cap: b (oldest queued) goes, at once
    assert b.done() and b.result().outcome is Outcome.DROPPED
    assert rec.released == ["b"]  # released at drop time, exactly once
    rec.gate.set()
    assert [(await f).outcome for f in (a, b, c)] == [Outcome.STORED, Outcome.DROPPED, Outcome.STORED]
    assert rec.released.count("b") == 1 and q.dropped == 1


async def test_queued_head_is_droppable_before_its_turn_starts() -> None:
    rec = Recorder()
    q = queue(rec, cap=100)
    a = q.enqueue(item("a", 60))  # queued, writer not started yet
    q.enqueue(item("b", 60))
    assert (await a).outcome is Outcome.DROPPED


async def test_single_oversized_item_exceeds_the_soft_cap() -> None:
    rec = Recorder()
    q = queue(rec, cap=10)
    f = q.enqueue(item("big", 500))
    assert q.pending_bytes == 500
    assert (await f).stored


async def test_barriers_are_never_shed_and_run_after_earlier_items() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=50)
    ran: list[str] = []

    async def action() -> str:
        ran.append(f"barrier after {list(rec.order)}")
        return "done"

    a = q.enqueue(item("a", 40))
    await rec.started.wait()
    bar = q.enqueue(SpillItem(key="bar", barrier=action))
    c = q.enqueue(item("c", 40))
    d = q.enqueue(item("d", 40))  # over cap: c goes (the barrier is skipped over)
    assert c.result().outcome is Outcome.DROPPED
    rec.gate.set()
    assert (await bar).value == "done" and (await d).stored and (await a).stored
    assert ran == ["barrier after ['a']"] and rec.order == ["a", "d"]
    # a barrier stores nothing: counted apart (found in review: "stored" counted it, and status said 3 stored)
    assert {k: q.counters()[k] for k in ("stored", "dropped", "barriers")} == {"stored": 2, "dropped": 1, "barriers": 1}


async def test_a_barrier_never_sheds_the_spill_it_waits_for() -> None:
    """Found in review: a droppable spill over the soft cap is kept while it is the newest; a barrier (no bytes) or
    a finish queued after it then shed it, the spill the barrier was meant to wait for."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=100)
    a = q.enqueue(item("a", 60))
    await rec.started.wait()
    x = q.enqueue(item("x", 60))  # over the cap, but the newest: kept
    bar = q.enqueue(SpillItem(key="bar", barrier=lambda: asyncio.sleep(0)))
    assert not x.done()
    rec.gate.set()
    assert (await x).stored and (await a).stored and (await bar).outcome is Outcome.STORED
    assert rec.order == ["a", "x"] and q.dropped == 0


async def test_non_droppable_data_items_are_kept_over_cap() -> None:
    rec = Recorder()
    q = queue(rec, cap=10)
    futs = [q.enqueue(item(str(i), 20, droppable=False)) for i in range(3)]
    assert q.pending_bytes == 60 and q.dropped == 0
    assert all(r.stored for r in await asyncio.gather(*futs))


async def test_cancel_where_drops_matching_queued_items_only() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    a = q.enqueue(item("k1"))
    await rec.started.wait()
    b = q.enqueue(item("k1"))
    bar = q.enqueue(SpillItem(key="k1", barrier=lambda: asyncio.sleep(0)))
    c = q.enqueue(item("k2"))
    assert q.cancel_where(lambda it: it.key == "k1") == 1  # not the in-flight one, not the barrier
    assert b.result().outcome is Outcome.CANCELLED and not bar.done()
    assert q.cancel_where(lambda it: it.key == "k1", barriers=True) == 1
    assert bar.result().outcome is Outcome.CANCELLED
    rec.gate.set()
    assert (await a).stored and (await c).stored and (q.cancelled, q.barriers) == (1, 1)  # the barrier apart


async def test_a_checkpoint_cancels_the_queued_older_ones_of_its_generation_only() -> None:
    """The rule every way in relies on: the daemon's queue too, where a client's checkpoints arrive."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    gen, other = checkpoint_namespace("g"), checkpoint_namespace("h")
    writing = q.enqueue(item("g0", namespace=gen))
    await rec.started.wait()
    older = q.enqueue(item("g1", namespace=gen))
    theirs = q.enqueue(item("h1", namespace=other))
    plain = q.enqueue(item("g2"))  # a spill given the same key is no checkpoint
    newer = q.enqueue(item("g3", namespace=gen))
    assert older.result().outcome is Outcome.CANCELLED and not writing.done()
    rec.gate.set()
    assert [(await f).outcome for f in (writing, theirs, plain, newer)] == [Outcome.STORED] * 4
    assert rec.order == ["g0", "h1", "g2", "g3"]


async def test_a_checkpoint_that_cannot_be_sized_leaves_the_older_one_queued() -> None:
    """Found in review: a newer checkpoint cancelled its generation's older ones before it was sized, so one whose
    plan failed (a live checkpoint found inconsistent) left the generation with neither, and resume found none."""
    rec = Recorder()
    rec.gate = asyncio.Event()

    def size(it: SpillItem) -> int:
        if it.key == "bad":
            raise ValueError("cannot plan this checkpoint")
        return 1

    q = SpillQueue(1000, rec.store, release=rec.release, bytes_of=size)
    gen = checkpoint_namespace("g")
    busy = q.enqueue(item("other"))
    await rec.started.wait()
    good = q.enqueue(item("good", namespace=gen))
    bad = q.enqueue(item("bad", namespace=gen))
    assert bad.result().outcome is Outcome.FAILED and not good.done()
    rec.gate.set()
    assert (await good).stored and (await busy).stored and rec.order == ["other", "good"]


async def test_what_finish_and_cancel_name() -> None:
    gen = checkpoint_namespace("g")
    named = [SpillItem(key="g"), SpillItem(namespace=gen), SpillItem(key="x", namespace="ns"), SpillItem()]
    assert [of_generation("g")(it) for it in named] == [True, True, False, False]
    assert [of_generation("")(it) for it in named] == [False, False, False, False]  # no key: not every spill
    assert [matching("ns", None)(it) for it in named] == [False, False, True, False]
    assert [matching(None, "g")(it) for it in named] == [True, False, False, False]
    with pytest.raises(ValueError, match="a namespace or a key"):
        matching(None, None)


async def test_a_failed_store_settles_failed_and_the_queue_keeps_going() -> None:
    rec = Recorder()
    rec.fail = {"bad"}
    q = queue(rec)
    futs = [q.enqueue(item(k)) for k in ("a", "bad", "c")]
    res = await asyncio.gather(*futs)
    assert [r.outcome for r in res] == [Outcome.STORED, Outcome.FAILED, Outcome.STORED]
    assert isinstance(res[1].error, OSError) and q.failed == 1
    assert sorted(rec.released) == ["a", "bad", "c"]


async def test_a_store_that_raises_a_base_exception_fails_its_item_and_the_next_enqueue_writes_again() -> None:
    """Found in review: only Exception and CancelledError were caught around a store, so a KeyboardInterrupt or
    SystemExit raised there left the item in flight unsettled for ever (a drain of it never returned), and then the
    items queued behind it (the writer had ended). The writer's item fails, those behind it are cancelled."""

    class Interrupted(BaseException):
        pass

    rec = Recorder()
    seen: list[str] = []

    async def store(it: SpillItem) -> str:
        if it.key == "a":
            raise Interrupted()
        return await rec.store(it)

    q = SpillQueue(1000, store, release=lambda it: seen.append(it.key), bytes_of=lambda it: it.payload or 0)
    a, behind = q.enqueue(item("a")), q.enqueue(item("behind"))
    settled = await asyncio.wait_for(a, 5)
    assert settled.outcome is Outcome.FAILED and isinstance(settled.error, Interrupted)
    assert (await asyncio.wait_for(behind, 5)).outcome is Outcome.CANCELLED and seen == ["a", "behind"]
    assert (await asyncio.wait_for(q.drain(5), 5)).done
    assert (await q.enqueue(item("b"))).stored  # a new writer takes the next one
    assert (await asyncio.wait_for(q.close(), 5)).done


async def test_a_release_that_raises_is_isolated_to_its_item() -> None:
    rec = Recorder()

    def release(it: SpillItem) -> None:
        if it.key == "boom":
            raise RuntimeError("dispose failed")
        rec.released.append(it.key)

    q = SpillQueue(1000, rec.store, release=release, bytes_of=lambda it: 1)
    res = await asyncio.gather(*(q.enqueue(item(k)) for k in ("a", "boom", "c")))
    assert all(r.stored for r in res) and rec.order == ["a", "boom", "c"]
    assert q.release_errors == 1 and rec.released == ["a", "c"]


async def test_a_barrier_that_raises_fails_alone() -> None:
    rec = Recorder()
    q = queue(rec)

    async def bad() -> None:
        raise RuntimeError("cleanup failed")

    res = await asyncio.gather(q.enqueue(SpillItem(key="b", barrier=bad)), q.enqueue(item("x")))
    assert res[0].outcome is Outcome.FAILED and res[1].stored


async def test_drain_waits_for_items_before_it_and_reports_timeouts() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    q.enqueue(item("a", 5))
    q.enqueue(item("b", 7))
    rep = await q.drain(timeout=0.05)
    assert not rep.done and rep.pending_items == 2 and rep.pending_bytes == 12
    rec.gate.set()
    rep = await q.drain()
    assert rep.done and rep.pending_items == 0 and rec.order == ["a", "b"] and rep.not_stored == 0
    assert (await q.drain()).done  # empty queue drains at once


async def test_a_drain_counts_the_items_that_settled_without_being_stored() -> None:
    """Settled is not durable: found in review, `spilld drain` said "everything acknowledged is durable" while the
    daemon's stop cancelled what it waited for."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    q.enqueue(item("a"))
    q.enqueue(item("b"))
    waiting = asyncio.ensure_future(q.drain())
    await asyncio.sleep(0)
    assert q.cancel_where(lambda it: it.key == "b") == 1
    rec.gate.set()
    rep = await waiting
    assert rep.done and rep.not_stored == 1


async def test_close_refuses_new_items_and_settles_everything() -> None:
    rec = Recorder()
    q = queue(rec)
    f = q.enqueue(item("a"))
    rep = await q.close()
    assert rep.done and (await f).stored
    late = q.enqueue(item("late"))
    assert late.result().outcome is Outcome.CANCELLED and rec.released.count("late") == 1


async def test_close_with_timeout_cancels_the_rest() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    a, b = q.enqueue(item("a")), q.enqueue(item("b"))
    rep = await q.close(timeout=0.05)
    assert not rep.done
    assert {a.result().outcome, b.result().outcome} == {Outcome.CANCELLED}
    assert sorted(rec.released) == ["a", "b"]


async def test_an_item_that_cannot_be_sized_fails_alone() -> None:
    rec = Recorder()

    def size(it: SpillItem) -> int:
        if it.key == "odd":
            raise TypeError("no size")
        return 1

    q = SpillQueue(10, rec.store, bytes_of=size)
    bad, good = q.enqueue(item("odd")), q.enqueue(item("ok"))
    assert bad.result().outcome is Outcome.FAILED and (await good).stored


async def test_would_fit_counts_what_could_be_shed() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=100)
    q.enqueue(item("a", 50, droppable=False))
    q.enqueue(item("b", 40))
    assert q.would_fit(50) and not q.would_fit(51)
    rec.gate.set()
    await q.drain()


async def test_counters_track_everything() -> None:
    rec = Recorder()
    rec.fail = {"f"}
    q = queue(rec, cap=25)
    rec.gate = asyncio.Event()
    futs: list[asyncio.Future[Any]] = [q.enqueue(item("a", 10))]
    await rec.started.wait()
    futs += [q.enqueue(item(k, 10)) for k in ("b", "f")]  # b dropped by the cap
    futs.append(q.enqueue(item("c", 1)))
    q.cancel_where(lambda it: it.key == "c")
    rec.gate.set()
    await asyncio.gather(*futs)
    c = q.counters()
    assert (c["stored"], c["dropped"], c["cancelled"], c["failed"], c["pending_items"]) == (1, 1, 1, 1, 0)
    assert c["peak_bytes"] >= 20


async def test_the_counters_add_up_to_every_item_queued_whatever_path_settled_it() -> None:
    """An item that cannot be sized, the one in flight when a close times out, one queued then, and one offered
    after the close: each settles once and is counted once (found in review: 1 of these 4 was counted)."""
    rec = Recorder()
    rec.gate = asyncio.Event()  # never set: the first item stays in flight

    def size(it: SpillItem) -> int:
        if it.key == "odd":
            raise TypeError("no size")
        return 10

    q = SpillQueue(1000, rec.store, bytes_of=size)
    futs = [q.enqueue(item(k)) for k in ("a", "odd", "b")]
    await rec.started.wait()
    await q.close(timeout=0.05)  # a cancelled in flight, b cancelled queued
    futs.append(q.enqueue(item("late")))
    outcomes = [f.result().outcome for f in futs]
    assert outcomes == [Outcome.CANCELLED, Outcome.FAILED, Outcome.CANCELLED, Outcome.CANCELLED]
    c = q.counters()
    assert (c["stored"], c["dropped"], c["failed"], c["cancelled"]) == (0, 0, 1, 3)
    assert c["pending_items"] == 0 and c["pending_bytes"] == 0


async def test_a_close_timeout_after_the_rename_never_leaves_an_unindexed_durable_file(tmp_path: Any) -> None:
    import threading

    from mlx_lm.models import cache as C

    import spilld
    from spilld import fileio
    from spilld.store import Store
    from tests.caches import fill

    renamed, go = threading.Event(), threading.Event()

    class HoldAfterRename(fileio.FileOps):
        def rename(self, src: str, dst: str) -> None:
            super().rename(src, dst)
            renamed.set()
            go.wait(10)  # the queue's close times out while the save is past its rename

    ident = spilld.Identity("m", "cfg", "tok", "")
    store = Store(tmp_path, disk_cap=2**40, ops=HoldAfterRename())
    q = SpillQueue(2**30, lambda it: store.put(it.tokens, it.caches, ident), bytes_of=lambda it: 1)
    fut = q.enqueue(SpillItem(tokens=list(range(8)), caches=[fill(C.KVCache(), 8)]))
    await asyncio.to_thread(renamed.wait, 10)
    asyncio.get_running_loop().call_later(0.05, go.set)
    report = await q.close(timeout=0)
    settled = await fut
    files = sorted(os.path.join(d, n) for d, _, ns in os.walk(tmp_path) for n in ns if n.endswith(".spilld"))
    assert not report.done
    if settled.outcome is Outcome.STORED:
        assert files == [e.path for e in store.entries]
    else:
        assert settled.outcome is Outcome.CANCELLED and files == [] and store.entries == []


async def test_a_caller_that_cancels_its_future_does_not_make_a_drain_say_done() -> None:
    """Found in review: the queue handed out the future its drain waited on, and a cancelled future is done, so a
    caller that gave up on the answer (a wait_for timeout) made drain and close report everything settled."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    futs = [q.enqueue(item("a")), q.enqueue(item("b"))]
    await rec.started.wait()  # "a" in flight, held open; "b" queued
    for f in futs:
        f.cancel()
    report = await q.drain(0.1)
    assert not report.done and report.pending_items == 2
    rec.gate.set()
    report = await q.drain(5)
    assert report.done and report.not_stored == 0 and rec.order == ["a", "b"]  # both stored: the items went on


async def test_close_keeps_to_its_timeout_when_a_step_is_stuck_in_a_thread() -> None:
    """Found in review: close cancelled the writer past its timeout and then waited for it without a bound, so a
    step stuck in a thread (a hung disk; an engine's lock held by the caller of close) held close as long."""
    import threading
    import time

    from spilld import queue as queue_module
    from spilld.lease import off_loop

    stuck = threading.Event()

    async def store(_: SpillItem) -> None:
        await off_loop(lambda: stuck.wait(30))

    q = SpillQueue(1000, store, bytes_of=lambda it: 10)
    fut = q.enqueue(item("a"))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    report = await q.close(0.1)
    took = time.monotonic() - t0
    stuck.set()
    assert not report.done and took < 0.1 + queue_module.CLOSE_STOP_S + 1.0, took
    assert (await fut).outcome is Outcome.CANCELLED  # once the thread came back


async def test_a_cancel_inside_an_item_cancels_that_item_and_the_writer_goes_on() -> None:
    """Found in review: a barrier whose action awaited a cancelled future ended the writer task; the spill queued
    after it never ran, and a drain without a timeout waited for ever."""
    rec = Recorder()
    q = queue(rec)

    async def action() -> None:
        gone = asyncio.get_running_loop().create_future()
        gone.cancel()
        await gone

    barrier = q.enqueue(SpillItem(key="b", barrier=action))
    after = q.enqueue(item("after"))
    assert (await barrier).outcome is Outcome.CANCELLED
    assert (await asyncio.wait_for(after, 5)).outcome is Outcome.STORED
    assert (await q.drain(5)).done


async def _writer_cancelled_from_outside() -> tuple[SpillQueue, Recorder, list[asyncio.Future[Any]]]:
    """A queue writing "a", "b" queued behind it, whose writer is then cancelled from outside the queue."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec)
    futs = [q.enqueue(item("a")), q.enqueue(item("b"))]
    await rec.started.wait()
    assert q._worker is not None
    q._worker.cancel()
    return q, rec, futs


async def test_a_writer_cancelled_from_outside_closes_the_queue() -> None:
    """As ``asyncio.run`` winds a loop down: every task cancelled (the writer with them), then the loop's threads
    shut down. Found in review: a spill enqueued then started a new writer, which failed on the executor already
    shut down with a plain RuntimeError. Now the queue is closed: the new item, and those left waiting, cancelled."""
    from spilld import errors

    q, rec, (first, waiting) = await _writer_cancelled_from_outside()
    await asyncio.sleep(0)
    late = q.enqueue(item("c"))
    results = await asyncio.wait_for(asyncio.gather(first, waiting, late), 5)
    assert [r.outcome for r in results] == [Outcome.CANCELLED] * 3
    assert isinstance(results[2].error, errors.Closed) and rec.order == []


# --- keep: a later spill of what a queued droppable item holds ----------------------------------------------------


async def test_a_kept_item_is_never_shed_keeps_its_place_and_nothing_more_is_queued() -> None:
    """Found in review: an entry mlx-lm's LRU evicted while its droppable write-behind was queued was spilled again,
    not droppable, and both were written. ``keep`` makes the queued one not droppable instead: no second item, never
    shed from then on whatever comes over the cap, counted against it as kept, and written in its own place (before
    a barrier queued after it, before or after the keep)."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=100)
    x = q.enqueue(item("x", 10))
    await rec.started.wait()  # x in flight
    a_item = item("a", 40)
    a = q.enqueue(a_item)
    early = q.enqueue(SpillItem(key="early", barrier=lambda: asyncio.sleep(0, "early")))
    kept = q.keep(item("a-again", 40, droppable=False), a_item)
    assert rec.released == [] and (q.pending_items, q.pending_bytes) == (3, 50)  # held until a ends, never queued
    late = q.enqueue(SpillItem(key="late", barrier=lambda: asyncio.sleep(0, "late")))
    assert not q.would_fit(60)  # a counts as kept: only what may be shed makes room
    others = [q.enqueue(item(f"b{i}", 60)) for i in range(4)]  # each over the cap: the droppable ones before go
    assert not a.done() and [f.done() for f in others] == [True, True, True, False]
    rec.gate.set()
    assert (await kept).stored and (await a).stored and (await x).stored
    assert (await early).value == "early" and (await late).value == "late"
    assert rec.order == ["x", "a", "b3"] and q.dropped == 3 and q.stored == 3
    assert rec.released.count("a-again") == 1  # let go once a was stored


async def test_keep_queues_nothing_for_an_item_in_flight_or_stored_and_queues_it_for_one_shed() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=100)
    a_item = item("a", 60)
    a = q.enqueue(a_item)
    await rec.started.wait()  # a in flight: the writer took it before the keep
    in_flight = q.keep(item("a-again", 60, droppable=False), a_item)
    assert q.pending_items == 1 and rec.released == []  # held while a is written, in case that fails
    b_item = item("b", 60)
    b = q.enqueue(b_item)
    q.enqueue(item("c", 60))  # over the cap: b is shed
    assert b.result().outcome is Outcome.DROPPED
    shed = q.keep(item("b-again", 60, droppable=False), b_item)  # the last copy: queued, not droppable
    q.enqueue(item("d", 60))  # over the cap: c goes, never b-again
    rec.gate.set()
    assert (await a).stored and (await in_flight).stored and (await shed).stored
    assert rec.released.count("a-again") == 1  # let go once a was stored
    stored = q.keep(item("a-again", 60, droppable=False), a_item)
    assert stored.done() and stored.result() is a.result()  # stored already: nothing queued
    assert (await q.drain(5)).done
    assert rec.order == ["a", "b-again", "d"] and q.stored == 3


async def test_an_item_that_fails_in_flight_has_the_spill_it_stood_for_written_next_even_as_the_queue_closes() -> None:
    """Found in review: a write-behind being written stood for its entry's eviction (``keep``), and when that write
    failed the evicted entry was lost. The later spill is held while it is written and, on a failure, written in its
    place, next; a drain (here a close's, taken before the failure) waits for it, and every item is let go once."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    rec.fail = {"a"}
    q = queue(rec, cap=100)
    a_item = item("a", 60)
    a = q.enqueue(a_item)
    await rec.started.wait()  # a in flight
    again = q.keep(item("a-again", 40, droppable=False), a_item)
    b = q.enqueue(item("b", 30))
    closing = asyncio.ensure_future(q.close(5))
    await asyncio.sleep(0)
    rec.gate.set()
    assert (await closing).done and (await again).stored and (await a).stored and (await b).stored
    assert a_item.ended is not None and a_item.ended.outcome is Outcome.FAILED  # before: again failed with a
    assert rec.order == ["a-again", "b"] and sorted(rec.released) == ["a", "a-again", "b"]
    assert (q.stored, q.failed, q.pending_items, q.pending_bytes) == (2, 0, 0, 0)


async def test_an_item_shed_in_flight_has_the_spill_it_stood_for_written_in_its_place() -> None:
    """Found in review, once a Spiller took the write gate (``admit_after``): its store judges a write-behind only
    after taking its bytes, so one the writer has may still be shed; the eviction's spill held on it (``keep``, not
    droppable) was let go with it, and the entry lost. It is written in its place, as after a failed write."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    rec.shed = {"a", "a-again"}  # (the later one is not droppable: never shed)
    q = queue(rec, cap=100)
    a_item = item("a", 60)
    a = q.enqueue(a_item)
    await rec.started.wait()  # a in flight
    again = q.keep(item("a-again", 40, droppable=False), a_item)
    rec.gate.set()
    assert (await again).stored and (await a).stored  # a's future follows the write made in its place
    assert a_item.ended is not None and a_item.ended.outcome is Outcome.DROPPED
    assert rec.order == ["a-again"] and sorted(rec.released) == ["a", "a-again"]
    assert (q.stored, q.dropped, q.pending_items, q.pending_bytes) == (1, 0, 0, 0)


async def test_a_droppable_keep_leaves_a_queued_item_droppable() -> None:
    """Past the integration's LAST_COPIES_HELD an evicted cache is spilled droppable: folded into its queued
    write-behind, which may still be shed over the cap (memory stays bounded), and its future says so."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    q = queue(rec, cap=100)
    q.enqueue(item("x", 10))
    await rec.started.wait()
    a_item = item("a", 60)
    q.enqueue(a_item)
    folded = q.keep(item("a-again", 60), a_item)
    q.enqueue(item("b", 60))
    assert (await folded).outcome is Outcome.DROPPED and q.pending_items == 2
    rec.gate.set()
    assert (await q.drain(5)).done and rec.order == ["x", "b"]


async def test_a_writer_cancelled_from_outside_settles_what_waits_with_no_spill_after() -> None:
    """Found in review of the change above: what waited in a queue whose writer was cancelled from outside was
    settled only by a next spill; with none coming, a drain or a close (``timeout=None``: a Spiller's default) waited
    for ever. That is how ``asyncio.run`` ends: every task cancelled at once, the writer and one that closes the
    queue in its ``finally``, and the run then never returned. What waits is cancelled as the writer ends."""
    q, rec, (first, waiting) = await _writer_cancelled_from_outside()  # and no spill comes after it
    report = await asyncio.wait_for(q.drain(), 5)
    assert report.done and report.pending_items == 0
    assert [(await f).outcome for f in (first, waiting)] == [Outcome.CANCELLED] * 2 and rec.order == []


async def test_asyncio_run_returns_when_a_cancelled_task_closes_the_queue_as_the_run_ends() -> None:
    """The case above as ``asyncio.run`` makes it: main returns with a task still waiting, whose ``finally`` closes
    the queue (no timeout), and the writer busy with one item, another queued. The run cancels both tasks at once."""
    import threading

    ended = threading.Event()
    tasks: list[asyncio.Future[None]] = []  # (held: a task nobody holds may be collected)

    async def main() -> None:
        rec = Recorder()
        rec.gate = asyncio.Event()
        q = queue(rec)
        q.enqueue(item("a"))
        q.enqueue(item("b"))
        await rec.started.wait()

        async def holder() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await q.close()

        tasks.append(asyncio.ensure_future(holder()))
        await asyncio.sleep(0)  # it waits; main returns, and the run cancels it and the writer at once

    def run() -> None:
        asyncio.run(main())
        ended.set()

    threading.Thread(target=run, daemon=True).start()  # (a daemon thread: one that never returns is left behind)
    ended_in_time = await asyncio.to_thread(ended.wait, 5)
    assert ended_in_time, "asyncio.run never returned: the close waited for items no writer would settle"


async def test_a_kept_queued_item_that_then_fails_has_the_spill_it_stood_for_written_next() -> None:
    """Found in review: an entry mlx-lm's LRU evicted while its write-behind was queued was folded into it (``keep``:
    promoted, the later spill let go), and when that write failed the evicted entry was lost, where a write-behind
    that failed before the eviction has the entry spilled again and one failing in its write has it written in its
    place. A queued one holds the later spill too until it ends: on a failure that one is written next, in its place."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    rec.fail = {"a"}
    q = queue(rec, cap=100)
    x = q.enqueue(item("x", 10))
    await rec.started.wait()  # x in flight: a waits behind it
    a_item = item("a", 40)
    a = q.enqueue(a_item)
    again = q.keep(item("a-again", 40, droppable=False), a_item)
    assert q.pending_items == 2 and rec.released == []  # held, not queued: a stands for it
    b = q.enqueue(item("b", 30))
    rec.gate.set()
    assert (await again).stored and (await a).stored and (await x).stored and (await b).stored  # before: FAILED
    assert rec.order == ["x", "a-again", "b"] and sorted(rec.released) == ["a", "a-again", "b", "x"]
    assert (q.stored, q.failed, q.pending_items, q.pending_bytes) == (3, 0, 0, 0)
