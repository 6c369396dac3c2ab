"""Execution leases: a step never overlaps an engine step and never runs on the loop thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from spilld import AsyncLockLease, IdleGate, NoLease, ThreadLockLease

pytestmark = pytest.mark.asyncio


async def test_no_lease_runs_off_the_loop_thread() -> None:
    loop_thread = threading.get_ident()
    assert await NoLease()(threading.get_ident) != loop_thread


async def test_async_lock_lease_holds_the_lock_and_keeps_the_loop_free() -> None:
    lock = asyncio.Lock()
    lease = AsyncLockLease(lock)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        for _ in range(20):
            ticks += 1
            await asyncio.sleep(0.001)

    t = asyncio.create_task(tick())
    held = await lease(lambda: (time.sleep(0.03), lock.locked())[1])
    await t
    assert held and not lock.locked() and ticks >= 5
    assert lease.longest_hold_s >= 0.03


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

    th = threading.Thread(target=engine)
    th.start()
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

    th = threading.Thread(target=engine)
    th.start()
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


async def test_idle_gate_engine_waits_only_for_the_running_step() -> None:
    gate = IdleGate()
    started = threading.Event()
    waited: list[float] = []

    def step() -> None:
        started.set()
        time.sleep(0.05)

    def engine() -> None:
        started.wait()
        t0 = time.perf_counter()
        with gate.busy():
            waited.append(time.perf_counter() - t0)

    th = threading.Thread(target=engine)
    th.start()
    await gate(step)
    th.join()
    assert 0.02 < waited[0] < 1.0


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
