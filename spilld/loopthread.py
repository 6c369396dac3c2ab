"""An asyncio event loop on a thread of its own, for synchronous callers (engines that decode in a thread)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from . import mlxthreads

T = TypeVar("T")
log = logging.getLogger("spilld.loopthread")

STOP_TASKS_TIMEOUT_S = 5.0  # how long ``stop`` lets cancelled tasks unwind before closing the loop
EXECUTOR_POLL_S = 0.01  # how often a stop looks whether the default executor's workers have ended (Python 3.11)
SELF_CLOSE_EXIT_S = 300.0  # the most the interpreter's exit waits for a close begun on the loop's own thread


async def _wind_down(timeout: float) -> None:
    """Cancel every other task on this loop and let them unwind (no 'Task was destroyed' at close), then let the
    default executor's threads end; both waits together at most ``timeout``. Run on the loop's own thread: the
    caller's may run a loop of its own, where this one cannot run."""
    me = asyncio.current_task()
    end = asyncio.get_running_loop().time() + timeout
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    _left_behind([t for t in tasks if not t.done()], timeout)
    # at interpreter exit no thread may be started for this; a worker stuck in a hung read is left behind
    with contextlib.suppress(RuntimeError, TimeoutError):
        await _end_default_executor(max(0.0, end - asyncio.get_running_loop().time()))


def _left_behind(tasks: list[asyncio.Task[Any]], timeout: float) -> None:
    """Say once, as a warning, which tasks a stop leaves on its closed loop (each stuck in a step that did not end
    within ``timeout``: a lock the engine holds, a hung disk). Found in review: asyncio said it instead, later, as
    an error with no cause ("Task was destroyed but it is pending!") whenever the task happened to be collected."""
    if not tasks:
        return
    names = ", ".join(sorted(t.get_name() for t in tasks))
    log.warning(
        "stopping: %d task(s) still in a step %.1f s after their cancel, left behind: %s", len(tasks), timeout, names
    )
    for t in tasks:
        t._log_destroy_pending = False  # type: ignore[attr-defined]  # (asyncio's own switch for that message)


async def _end_default_executor(timeout: float) -> None:
    """Let the loop's default executor's threads end, waiting at most ``timeout``."""
    loop = asyncio.get_running_loop()
    try:
        ending = loop.shutdown_default_executor(timeout)  # type: ignore[call-arg]  # (3.12+, uvloop)
    except TypeError:  # 3.11's takes no timeout, and once cancelled it joins its thread on this loop without a
        ending = None  # bound: a worker stuck on a lock or a hung disk held the loop for ever (found in review)
    if ending is not None:
        await asyncio.wait_for(ending, timeout + 1)
        return
    executor = getattr(loop, "_default_executor", None)
    if executor is None:
        return
    threads = list(getattr(executor, "_threads", ()))  # its workers: waited for here, no thread of ours to end
    executor.shutdown(wait=False)
    deadline = loop.time() + timeout
    while any(t.is_alive() for t in threads) and loop.time() < deadline:
        await asyncio.sleep(EXECUTOR_POLL_S)


class LoopThread:
    """Runs coroutines on a private loop; ``stop`` ends the thread and closes the loop (idempotent)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopping = False
        self._pending: set[concurrent.futures.Future[Any]] = set()  # calls waited on from other threads
        self._self_stopped = False  # stopped from its own thread: the thread closes the loop when it ends
        self._closed = threading.Event()  # the loop is closed: a stop begun by another thread is over
        self._on_close: list[Callable[[], None]] = []
        self._thread = mlxthreads.start_thread(self._serve, name, daemon=True)
        # A caller that exits without ``stop`` must not leave a thread that ran mlx work alive at interpreter
        # shutdown (mlx aborts the process: 'terminate called without an active exception').
        atexit.register(self.stop)

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it. ``concurrent.futures.CancelledError`` once ``stop`` has begun
        (a call it would never run is not waited for), ``RuntimeError`` from the loop's own thread (a callback of a
        future the loop settles: the call would wait for itself). ``timeout``: ``TimeoutError`` past it, the call
        cancelled (for a caller that must not wait on a busy loop)."""
        if threading.current_thread() is self._thread:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise RuntimeError(
                "a blocking call from the client's own loop thread (a future's callback) would wait for itself"
            )
        with self._lock:
            if self._stopping:
                if asyncio.iscoroutine(coro):
                    coro.close()
                raise concurrent.futures.CancelledError("the loop thread is stopping")
            fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _serve(self) -> None:
        self.loop.run_forever()
        if self._self_stopped:  # nobody waits to close it: this thread does, last
            self._close()
            atexit.unregister(self.stop)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once the loop is closed (on the thread that closes it): for what it will never run."""
        self._on_close.append(hook)

    @property
    def on_own_thread(self) -> bool:
        """The caller is the loop's own thread (a callback of a future the loop settles)."""
        return threading.current_thread() is self._thread

    def stop(
        self, first: Awaitable[Any] | None = None, wait: float | None = None, unwind: float = STOP_TASKS_TIMEOUT_S
    ) -> None:
        """Run ``first`` (if given), cancel what still runs on the loop (letting it unwind, for at most ``unwind``
        seconds: a task waiting on a thread outlasts its cancel), end the thread, close the loop. A call another
        thread waits on that the loop will never run is cancelled, never left waiting.

        From the loop's own thread (a future's callback) nothing can be waited for: the same happens after the
        callback returns, and the thread closes its loop as it ends; a later ``stop`` from another thread (a close,
        or the interpreter's exit) waits for that end: at most ``wait`` seconds (the caller's own timeout; it may
        hold what that close waits for, such as the engine's lock)."""
        with self._lock:
            again, self._stopping = self._stopping, True
            self_stopped = self._self_stopped
            if not again and self.on_own_thread:
                self._self_stopped = True
        if again or self.loop.is_closed():
            if asyncio.iscoroutine(first):
                first.close()
            if self_stopped and not self.on_own_thread:  # it stops itself: wait for that (review: an exit that
                self._thread.join(wait)  # did not wait lost the spills its close was still draining)
            elif not self.on_own_thread and not self.loop.is_closed():  # another thread's stop is under way: wait
                # for its end, never repeat it (found in review: two closes at once closed the loop twice, and raised)
                self._closed.wait(wait)
            return
        if self.on_own_thread:
            self.loop.create_task(self._stop_here(first))
            # The interpreter's exit waits for this close before its thread pools refuse work (they do so in
            # threading's exit hooks, which run before atexit's, the later registered first); else a close still
            # draining spills could write none (found in review). atexit's hook stays too, as a fallback.
            with contextlib.suppress(AttributeError, RuntimeError):  # (no such hook, or the exit has begun)
                threading._register_atexit(functools.partial(self._thread.join, SELF_CLOSE_EXIT_S))  # type: ignore[attr-defined]
            return
        atexit.unregister(self.stop)
        if self._thread.is_alive():
            unwound = asyncio.run_coroutine_threadsafe(self._unwind(first, unwind), self.loop)
            with contextlib.suppress(Exception):
                unwound.result(None if first is not None else unwind + 2)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self._close()

    async def _unwind(self, first: Awaitable[Any] | None, unwind: float = STOP_TASKS_TIMEOUT_S) -> None:
        if first is not None:  # bounded by its own arguments (a client's close by its timeout)
            with contextlib.suppress(Exception):
                await first
        await _wind_down(unwind)

    async def _stop_here(self, first: Awaitable[Any] | None) -> None:
        try:
            await self._unwind(first)
        finally:
            self.loop.stop()

    def _close(self) -> None:
        with self._lock:
            left, self._pending = list(self._pending), set()
        for fut in left:
            fut.cancel()
        self.loop.close()
        try:
            for hook in self._on_close:
                hook()
        finally:
            self._closed.set()

    @classmethod
    def start_with(cls, name: str, setup: Callable[[LoopThread], T]) -> tuple[LoopThread, T]:
        """Start a loop thread and run ``setup`` with it; if setup fails the thread is stopped, never leaked."""
        lt = cls(name)
        try:
            return lt, setup(lt)
        except BaseException:
            lt.stop()
            raise
