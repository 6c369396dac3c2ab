"""Threads that run mlx work free their per-thread state before they end.

mlx keeps each thread's streams in thread-local state, and its contract (since 0.32) is that a thread other than
the main one calls ``mx.clear_streams()`` before it ends: freed later, at thread or process teardown, they abort
the process ("terminate called without an active exception", exit 134). Measured with mlx 0.32.4 on Linux: a
script whose one pool of two threads evaluated a product aborted at exit in 12 of 20 runs, 0 of 20 with the pool's
threads freeing their streams as they end (``docs/reliability.md``). An engine must not die at exit because it
embedded spilld, so every thread spilld starts is made here (``worker_pool``, ``start_thread``), and work it hands
to a pool it did not make is wrapped (``releasing``).
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_local = threading.local()


def release_streams() -> None:
    """Free the calling thread's mlx streams: the last mlx call a thread makes. A no-op in a process that never
    imported mlx (the daemon) and with an mlx that has no ``clear_streams`` (it frees them itself)."""
    mx = sys.modules.get("mlx.core")
    clear = getattr(mx, "clear_streams", None) if mx is not None else None
    if clear is not None:
        clear()


class _AtThreadEnd:
    """Held in a thread-local slot: Python drops it as it clears its thread's state, on that thread when it ends,
    but on the main thread at interpreter exit for a daemon thread still running then: only its own thread frees."""

    __slots__ = ("ident",)

    def __init__(self) -> None:
        self.ident = threading.get_ident()

    def __del__(self) -> None:
        if threading.get_ident() != self.ident:  # never the main thread's streams, which it may still use
            return
        try:
            release_streams()
        except Exception:  # nothing to report to at thread teardown; mlx's own teardown is what remains
            pass


def release_at_thread_end() -> None:
    """Have the calling thread free its mlx streams when it ends (a pool's initializer; idempotent)."""
    if getattr(_local, "at_end", None) is None:
        _local.at_end = _AtThreadEnd()


def releases_at_thread_end() -> bool:
    """Whether the calling thread will free its mlx streams when it ends."""
    return getattr(_local, "at_end", None) is not None


def releasing(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, made to register the release on whichever thread runs it: for work handed to a pool spilld did not
    make (an event loop's default executor), whose threads then run spilld's mlx work."""

    def run() -> T:
        release_at_thread_end()
        return fn()

    return run


def worker_pool(
    max_workers: int, name: str, initializer: Callable[[], None] | None = None
) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads free their mlx streams when they end; ``initializer`` runs first on each."""

    def start() -> None:
        release_at_thread_end()
        if initializer is not None:
            initializer()

    return concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=start)


def start_thread(target: Callable[[], Any], name: str, *, daemon: bool = False) -> threading.Thread:
    """Start a thread running ``target`` that frees its mlx streams when it ends."""

    def run() -> None:
        release_at_thread_end()
        target()

    th = threading.Thread(target=run, name=name, daemon=daemon)
    th.start()
    return th
