"""What the daemon tells its service manager as it runs: ready, alive (watchdog), stopping, still draining.

All of it goes through :class:`~spilld.service.sdnotify.Notifier`, so outside systemd every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from .sdnotify import Notifier, watchdog_interval

log = logging.getLogger("spilld.service")

EXTEND_EVERY_S = 5.0  # how often a draining stop asks for more time
EXTEND_WINDOW_S = 15.0  # each request covers three periods, so one late turn of the loop is no harm
STOP_GRACE_S = 10.0  # after the drain deadline: answering commits, closing clients, the last log line


class Lifecycle:
    """The daemon's side of the service-manager conversation."""

    def __init__(self, notifier: Notifier, watchdog_s: float | None) -> None:
        self.notifier = notifier
        self.watchdog_s = watchdog_s
        self._watchdog: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls) -> Lifecycle:
        return cls(Notifier.from_env(), watchdog_interval())

    def ready(self, status: str) -> None:
        """The socket accepts connections and the index is built."""
        self.notifier.ready(status)

    def start_watchdog(self) -> None:
        """Ping from a task on the event loop: a loop that stalls stops the pings, which is the point."""
        if self.watchdog_s is not None and self.notifier.enabled and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._ping(self.watchdog_s))

    async def _ping(self, every: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(every)

    def stopping(self, status: str) -> None:
        self.notifier.stopping(status)

    @contextlib.asynccontextmanager
    async def extending_stop(self, budget_s: float, progress: Callable[[], str]) -> AsyncIterator[None]:
        """While the body runs (the drain), keep asking for a little more stop time, at most until
        ``budget_s`` plus a grace has passed; ``progress`` gives the STATUS line of each request."""
        task = None
        if self.notifier.enabled:
            until = time.monotonic() + budget_s + STOP_GRACE_S
            self._extend_once(until, progress)  # now, not on the task's first turn: a short drain never gives it one
            task = asyncio.get_running_loop().create_task(self._extend(until, progress))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _extend_once(self, until: float, progress: Callable[[], str]) -> None:
        """Ask for one window more, never past the end of the budget."""
        left = until - time.monotonic()
        if left > 0:
            self.notifier.extend_timeout(min(EXTEND_WINDOW_S, left), progress())

    async def _extend(self, until: float, progress: Callable[[], str]) -> None:
        while (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(EXTEND_EVERY_S, left))
            self._extend_once(until, progress)

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        self.notifier.close()
