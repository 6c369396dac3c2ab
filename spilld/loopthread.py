"""An asyncio event loop on a thread of its own, for synchronous callers (engines that decode in a thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on a private loop; ``stop`` ends the thread and closes the loop (idempotent)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    @classmethod
    def start_with(cls, name: str, setup: Callable[[LoopThread], T]) -> tuple[LoopThread, T]:
        """Start a loop thread and run ``setup`` with it; if setup fails the thread is stopped, never leaked."""
        lt = cls(name)
        try:
            return lt, setup(lt)
        except BaseException:
            lt.stop()
            raise
