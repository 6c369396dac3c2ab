"""Execution leases: a step never overlaps an engine step and never runs on the loop thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import spilld
from spilld import AsyncLockLease, IdleGate, NoLease, ThreadLockLease, mlxthreads
from spilld.lease import FairLock

pytestmark = pytest.mark.asyncio


async def test_no_lease_runs_off_the_loop_thread() -> None:
    loop_thread = threading.get_ident()
    assert await NoLease()(threading.get_ident) != loop_thread


async def test_async_lock_lease_holds_the_lock_and_keeps_the_loop_free() -> None:
    lock = asyncio.Lock()
    lease = AsyncLockLease(lock)
    events: list[Any] = []
    running, ticked = threading.Event(), threading.Event()
    done = False

    async def loop_turns() -> None:
        while not done:
            if running.is_set():
                events.append(("turn", lock.locked()))
                ticked.set()
            await asyncio.sleep(0)

    def step() -> bool:
        running.set()
        events.append("start")
        turned = ticked.wait(5)  # returns at once if the loop turns while this runs; never if it runs on the loop
        events.append("end")
        running.clear()
        return turned

    t = asyncio.create_task(loop_turns())
    turned = await lease(step)
    done = True
    await t
    assert turned and not lock.locked()
    # the loop turned while the step ran, with the engine's lock held throughout
    assert events.index("start") < events.index(("turn", True)) < events.index("end")
    assert ("turn", False) not in events
    assert lease.longest_hold_s > 0


async def test_thread_lock_lease_waits_for_the_engine_thread() -> None:
    lock = threading.Lock()
    lease = ThreadLockLease(lock)
    events: list[str] = []
    entered = threading.Event()

    def engine() -> None:
        with lock:
            entered.set()
            events.append("engine start")
            time.sleep(0.05)
            events.append("engine end")

    th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    entered.wait()
    await lease(lambda: events.append("step"))
    th.join()
    assert events == ["engine start", "engine end", "step"]


async def test_idle_gate_never_overlaps_engine_steps() -> None:
    gate = IdleGate()
    spans: list[tuple[str, float, float]] = []
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            with gate.busy():
                t0 = time.perf_counter()
                time.sleep(0.002)
                spans.append(("engine", t0, time.perf_counter()))
            time.sleep(0.0005)  # the gap between decode steps

    def step() -> None:
        t0 = time.perf_counter()
        time.sleep(0.001)
        spans.append(("step", t0, time.perf_counter()))

    th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    for _ in range(20):
        await gate(step)
    stop.set()
    th.join()
    steps = [s for s in spans if s[0] == "step"]
    engines = [s for s in spans if s[0] == "engine"]
    assert len(steps) == 20 and engines
    for _, a0, a1 in steps:
        for _, b0, b1 in engines:
            assert a1 <= b0 or b1 <= a0, "a background step overlapped an engine step"


async def _engine_arrives_during_a_step() -> list[str]:
    """One background step runs, the engine arrives, a second step is queued: the order things happened in."""
    gate = IdleGate()
    events: list[str] = []
    first_running = threading.Event()

    def first() -> None:
        first_running.set()
        events.append("first start")
        deadline = time.monotonic() + 10
        while not gate._engine_waiting and time.monotonic() < deadline:  # until the engine is at the gate
            time.sleep(0.001)
        time.sleep(0.01)  # and the second step too
        events.append("first end")

    def engine() -> None:
        first_running.wait()
        events.append("engine arrives")
        with gate.busy():
            events.append("engine in")
            time.sleep(0.01)
            events.append("engine out")

    th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    one = asyncio.ensure_future(gate(first))
    while not first_running.is_set():
        await asyncio.sleep(0.001)
    two = gate(lambda: events.append("second start"))  # queued behind the first, like the engine
    await asyncio.gather(one, two)
    th.join()
    return events


async def test_idle_gate_engine_waits_only_for_the_running_step() -> None:
    for _ in range(5):  # a gate that let a queued step go first would lose the race only some of the time
        # The engine waits for the running step, then goes before the step queued after it.
        assert await _engine_arrives_during_a_step() == [
            "first start",
            "engine arrives",
            "first end",
            "engine in",
            "engine out",
            "second start",
        ]


async def test_a_step_that_raises_releases_the_lease() -> None:
    lock = threading.Lock()
    lease = ThreadLockLease(lock)

    def boom() -> None:
        raise ValueError("step failed")

    with pytest.raises(ValueError):
        await lease(boom)
    assert not lock.locked()
    gate = IdleGate()
    with pytest.raises(ValueError):
        await gate(boom)
    with gate.busy():  # would hang if the gate stayed owned
        pass


async def test_a_fair_lock_hands_over_in_arrival_order_so_a_fast_engine_cannot_starve_a_step() -> None:
    lock = spilld.FairLock()
    order: list[str] = []
    lock.acquire()  # the engine's step
    waiter = threading.Thread(target=lambda: (lock.acquire(), order.append("spill step"), lock.release()))
    waiter.start()
    while lock.waiting() < 1:  # the write step waits for the engine's lock
        time.sleep(0.001)
    order.append("engine step 1")
    lock.release()
    with lock:  # the engine at once again: served after the waiting step
        order.append("engine step 2")
    waiter.join(5)
    assert order == ["engine step 1", "spill step", "engine step 2"]
    assert not lock.locked() and lock.acquire(blocking=False)
    assert not lock.acquire(blocking=False)  # held: a try fails
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


async def test_a_thread_lock_lease_on_a_fair_lock_runs_while_an_engine_loops() -> None:
    lock = spilld.FairLock()
    lease = spilld.ThreadLockLease(lock)
    stop = threading.Event()
    steps = [0]

    def engine() -> None:
        while not stop.is_set():
            with lock:  # a decode loop that takes its lock back at once
                steps[0] += 1

    t = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    try:
        ran = await asyncio.wait_for(lease(lambda: "ran"), timeout=10)
    finally:
        stop.set()
        t.join(5)
    assert ran == "ran" and steps[0] > 0


class _Interrupt(Exception):
    pass


def _interrupt_main_in(seconds: float) -> Any:
    """Raise ``_Interrupt`` in the main thread ``seconds`` from now, as a Ctrl-C would (a signal's handler)."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupt

    old = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
    return old


async def test_a_fair_lock_wait_interrupted_gives_up_its_turn() -> None:
    """Found in review: an acquire whose wait raised (a Ctrl-C) kept its ticket, and when its turn came nobody
    took it: the lock stayed held for ever and every later acquire waited."""
    import signal

    lock = FairLock()
    lock.acquire()  # held (by the engine's other step, say)
    old = _interrupt_main_in(0.2)
    try:
        with pytest.raises(_Interrupt):
            lock.acquire()  # waits, then is interrupted
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert lock.waiting() == 0
    lock.release()
    assert not lock.locked() and lock.acquire(blocking=False)
    lock.release()


async def test_an_idle_gate_wait_interrupted_counts_no_engine_waiting() -> None:
    """Found in review: an engine step whose wait for a background step raised stayed counted as waiting, and no
    background step ever ran again."""
    import signal

    gate = IdleGate()
    inside, leave = threading.Event(), threading.Event()

    def background() -> None:
        inside.set()
        leave.wait(5)

    t = threading.Thread(target=lambda: gate._run_when_idle(background))
    t.start()
    assert inside.wait(5)
    old = _interrupt_main_in(0.2)
    try:
        with pytest.raises(_Interrupt), gate.busy():
            pass  # waits for the background step, then is interrupted
    finally:
        signal.signal(signal.SIGUSR1, old)
        leave.set()
        t.join(5)
    ran = threading.Event()
    t2 = threading.Thread(target=lambda: gate._run_when_idle(ran.set))
    t2.start()
    t2.join(5)
    assert ran.is_set()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["off_loop", "within"])
async def test_work_on_a_thread_is_outlasted_through_a_second_cancel(how: str) -> None:
    """Found in review: a caller cancelled while its work ran on a thread waited for it, but a second cancel cut
    that wait short: a save then closed its file while its write still ran on the thread."""
    from spilld.lease import off_loop, within

    running, finish = threading.Event(), threading.Event()

    def work() -> None:
        running.set()
        finish.wait(10)

    aw = off_loop(work) if how == "off_loop" else within(off_loop(work), 30, "a step")
    task = asyncio.ensure_future(aw)
    assert await asyncio.to_thread(running.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.2)
    assert not task.done()  # still waiting for the thread
    finish.set()
    await asyncio.wait([task], timeout=10)
    assert task.cancelled()
