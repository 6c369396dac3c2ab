"""Execution leases: run a step while the engine is between its own steps.

A lease is any ``run_step(fn) -> awaitable`` callable. It runs ``fn`` (a short,
blocking piece of work) at a moment the engine is not running a step, and
returns its result. The adapters below never run ``fn`` on the event loop
thread, so a step never stalls the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from . import errors, mlxthreads

T = TypeVar("T")


class RunStep(Protocol):
    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


BACKGROUND_NICE = 10  # how much lower than the engine spilld's hashing and writing threads run


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Make the calling thread yield the CPU to the engine (Linux: per-thread nice; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


_background: concurrent.futures.ThreadPoolExecutor | None = None
_background_lock = threading.Lock()  # two first callers (two loops, or a loop and a thread) make one pool


_compute: concurrent.futures.ThreadPoolExecutor | None = None


def _compute_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for pure computation (a lookup's comparisons): never taken by a file call a hung disk holds."""
    global _compute
    with _background_lock:
        if _compute is None:
            _compute = mlxthreads.worker_pool(2, "spilld-cpu")
        return _compute


_held: concurrent.futures.ThreadPoolExecutor | None = None


def _held_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for work an engine waits for (a step it granted its lease for): never queued behind background
    work (the shared tier's reads, a scrub's), and at normal priority, since the engine is idle meanwhile."""
    global _held
    with _background_lock:
        if _held is None:
            _held = mlxthreads.worker_pool(2, "spilld-held")
        return _held


_idle: concurrent.futures.ThreadPoolExecutor | None = None


def _idle_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A thread for idle-time reads (the scrub's, the warm start's): one such read a hung disk holds never holds a
    thread a write needs (found in review: a scrub's read and a timed-out write took both of the writers')."""
    global _idle
    with _background_lock:
        if _idle is None:
            _idle = mlxthreads.worker_pool(1, "spilld-idle", initializer=lower_thread_priority)
        return _idle


def _background_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _background
    with _background_lock:
        if _background is None:
            _background = mlxthreads.worker_pool(2, "spilld-io", initializer=lower_thread_priority)
        return _background


async def off_loop(
    fn: Callable[[], T], *, background: bool = False, compute: bool = False, held: bool = False, idle: bool = False
) -> T:
    """Run blocking work on a worker thread; if cancelled, let it finish before unwinding.

    ``background`` work (hashing, writing: nothing that holds the engine's lock)
    runs on low-priority threads, so on a machine whose cores the engine keeps
    busy it takes only what the engine leaves. ``compute`` work (no file calls)
    runs on threads of its own, which a hung disk never holds. ``held`` work (a step an engine granted its lease
    for, and waits on) runs on threads of its own too, never behind background work; ``idle`` reads (the scrub's,
    the warm start's) on one of their own, at low priority.
    """
    loop = asyncio.get_running_loop()
    pool = (
        _held_pool() if held else _compute_pool() if compute else _idle_pool() if idle
        else _background_pool() if background else None
    )  # fmt: skip
    # spilld's own pools free their threads' mlx streams already; a loop's default executor is told per call
    fut = loop.run_in_executor(pool, mlxthreads.releasing(fn) if pool is None else fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await outlast(fut)
        raise


async def outlast(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut`` (work on a thread, which no cancel can stop) to end, through any number of cancels: a
    caller cancelled twice must not go on to close what that thread still uses (found in review: a second cancel
    closed a save's file under its running write). The caller re-raises its own cancel after."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([fut])


class Droppable:
    """``fn`` for a worker thread, which its caller may give up until a thread begins it: a step queued behind
    threads that hung writes hold (their syscalls past their deadline, still stuck) is dropped, never run later."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._begun = False
        self._dropped = False

    def __call__(self) -> Any:
        with self._lock:  # begun or dropped, never both
            if self._dropped:
                raise errors.StorageTimeout("a step given up before a thread began it")
            self._begun = True
        return self._fn()

    def drop(self) -> bool:
        """Give the step up if no thread has begun it; True when it never will."""
        with self._lock:
            self._dropped = not self._begun
            return self._dropped


class Begun:
    """When a step's work began (``time.monotonic()``), set by the thread that runs it: the loop is not woken
    for it, ``within`` reads it when its wait ends."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    def mark(self) -> None:
        self.at = time.monotonic()


async def within(
    work: Awaitable[T],
    deadline_s: float | None,
    what: str,
    on_late: Callable[[], None] | None = None,
    begun: Begun | None = None,
) -> T:
    """``work``'s result if it ends within ``deadline_s`` (None: no deadline), counted from ``begun`` if given
    (a step that first waits for an engine's grant: that wait is the lease's to bound, not the disk's). Past it,
    ``StorageTimeout`` at once: the work is left to end on its own (a thread in a hung syscall cannot be stopped)
    and ``on_late`` runs once it has. Cancelled meanwhile, it waits for the work to end, as ``off_loop`` does,
    unless the work has not begun (it waits for a grant): then the work is cancelled too."""
    if deadline_s is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        wait_s = deadline_s
        while True:
            done, _ = await asyncio.wait([task], timeout=wait_s)
            if done or begun is None:
                break
            # not begun yet: a whole deadline more; begun: what is left of the deadline from then
            wait_s = deadline_s if begun.at is None else begun.at + deadline_s - time.monotonic()
            if wait_s <= 0:
                break
    except asyncio.CancelledError:
        if begun is not None and begun.at is None:  # nothing runs yet: a stop must not wait out a grant's timeout
            task.cancel()
        await outlast(task)
        if not task.cancelled():
            task.exception()  # retrieved: it ends with the cancel, never logged as lost
        raise
    if task in done:
        return task.result()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its late error is retrieved, not logged
    if on_late is not None:
        task.add_done_callback(lambda _: on_late())
    raise errors.StorageTimeout(f"{what} did not return within {deadline_s:g} s: the disk is hung or failing")


class Pace:
    """Background reads that yield to serving: ``rate`` bytes a second on average, counted from the start less
    the time spent waiting for ``busy()`` to turn false (no burst to catch up after a pause)."""

    def __init__(
        self,
        rate: float,
        busy: Callable[[], bool],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        poll_s: float,
        on_pause: Callable[[bool], None] = lambda paused: None,
    ) -> None:
        self.rate, self.busy, self.clock, self.sleep = rate, busy, clock, sleep
        self.poll_s, self.on_pause = poll_s, on_pause
        self.start = clock()
        self.done = 0

    async def wait_idle(self) -> None:
        """Return once ``busy()`` is false; the time waited does not count against the rate."""
        if not self.busy():
            return
        t0 = self.clock()
        self.on_pause(True)
        while self.busy():
            await self.sleep(self.poll_s)
        self.on_pause(False)
        self.start += self.clock() - t0

    async def took(self, nbytes: int) -> None:
        """``nbytes`` more were read: sleep until the average is back at the rate."""
        self.done += nbytes
        ahead = self.start + self.done / self.rate - self.clock()
        if ahead > 0:
            await self.sleep(ahead)


class NoLease:
    """No engine to respect (a standalone tool, the daemon with no grantor): run on a worker thread."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]:
        return off_loop(fn)


class AsyncLockLease:
    """The engine runs on this event loop and holds ``lock`` (an asyncio.Lock) for each of its steps."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock
        self.longest_hold_s = 0.0

    async def __call__(self, fn: Callable[[], T], /) -> T:
        async with self.lock:
            t0 = time.perf_counter()
            try:
                return await off_loop(fn)
            finally:
                self.longest_hold_s = max(self.longest_hold_s, time.perf_counter() - t0)


class FairLock:
    """A generation lock that hands over in arrival order (a ticket lock), for engines that decode in a thread.

    With a plain ``threading.Lock``, an engine that takes the lock again as soon as it released it (a GPU decode
    loop does: its step is a short ``mx.eval``) starves a ``ThreadLockLease`` waiting for it: the releasing
    thread keeps running and wins the lock back, so a spill never runs while decode does. With this lock the
    waiting write step runs after the engine's current step, and the engine's next step after that one: at most
    one spill step between two decode tokens, which is the lease's contract.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket that holds the lock
        self._abandoned: set[int] = set()  # tickets whose waits ended in an exception: skipped when their turn comes

    def acquire(self, blocking: bool = True) -> bool:
        with self._cond:
            if not blocking and self._serving != self._next:
                return False
            ticket = self._next
            self._next += 1
            try:
                while self._serving != ticket:
                    self._cond.wait()
            except BaseException:  # a Ctrl-C in the wait: the ticket is given up, never left to hold the lock
                if self._serving == ticket:  # (found in review: every later acquire waited for ever)
                    self._advance()
                else:
                    self._abandoned.add(ticket)
                raise
            return True

    def release(self) -> None:
        with self._cond:
            if self._serving == self._next:
                raise RuntimeError("release of an unlocked FairLock")
            self._advance()

    def _advance(self) -> None:
        """The lock to the next ticket still waiting (the condition's lock held)."""
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._serving != self._next

    def waiting(self) -> int:
        """How many threads wait for the lock (beyond its holder)."""
        with self._cond:
            return max(0, self._next - self._serving - 1 - len(self._abandoned))

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ThreadLockLease:
    """The engine decodes in its own thread (as mlx-lm's server does) under ``lock``, a threading.Lock."""

    def __init__(self, lock: threading.Lock | threading.RLock | FairLock) -> None:
        self.lock = lock
        self.longest_hold_s = 0.0

    def _locked(self, fn: Callable[[], T]) -> T:
        with self.lock:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.longest_hold_s = max(self.longest_hold_s, time.perf_counter() - t0)

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]:
        return off_loop(lambda: self._locked(fn))


class IdleGate:
    """A lease for engines that mark their busy periods; background work runs only when idle.

    The engine wraps each step in ``with gate.busy():``. A background step waits
    until the engine is neither running nor waiting, and takes ownership in the
    same critical section as that check, so no engine step can start between
    the idle check and the background step (the race an idle poll has). An
    engine that arrives during a background step waits for that one step only.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._engine_active = 0
        self._engine_waiting = 0
        self._background = False
        self.longest_hold_s = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._cond:
            self._engine_waiting += 1
            try:
                while self._background:
                    self._cond.wait()
            finally:  # a Ctrl-C in the wait must not count an engine waiting for ever (no background step would run)
                self._engine_waiting -= 1
                self._cond.notify_all()
            self._engine_active += 1
        try:
            yield
        finally:
            with self._cond:
                self._engine_active -= 1
                self._cond.notify_all()

    def _run_when_idle(self, fn: Callable[[], T]) -> T:
        with self._cond:
            while self._engine_active or self._engine_waiting or self._background:
                self._cond.wait()
            self._background = True  # ownership taken with no gap after the check
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.longest_hold_s = max(self.longest_hold_s, time.perf_counter() - t0)
            with self._cond:
                self._background = False
                self._cond.notify_all()

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]:
        return off_loop(lambda: self._run_when_idle(fn))
