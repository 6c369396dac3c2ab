"""What the daemon tells its service manager as it runs: ready, alive (watchdog), stopping, still working.

All of it goes through :class:`~spilld.service.sdnotify.Notifier`, so outside systemd every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .sdnotify import Notifier, watchdog_interval

log = logging.getLogger("spilld.service")

EXTEND_EVERY_S = 5.0  # how often slow work (the start-up scan, a drain) is checked for progress
EXTEND_WINDOW_S = 15.0  # what one request asks for: three checks, so one late turn of the loop is no harm
STOP_GRACE_S = 10.0  # after the drain deadline: answering commits, closing clients, the last log line


@dataclass(frozen=True)
class Progress:
    """One look at slow work. ``marks`` change as it advances (items and bytes left, entries found);
    ``busy`` says that a step of it (one write) is under way; ``status`` is its STATUS= line."""

    marks: tuple[int, ...]
    busy: bool
    status: str

    def advanced_since(self, before: Progress) -> bool:
        return self.busy or self.marks != before.marks


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
    async def extending(self, probe: Callable[[], Progress], budget_s: float | None = None) -> AsyncIterator[None]:
        """While the body runs, look at ``probe`` every EXTEND_EVERY_S; if the work advanced since the last
        look, ask systemd for EXTEND_WINDOW_S more (EXTEND_TIMEOUT_USEC), never past ``budget_s`` plus
        STOP_GRACE_S. Work that stalls asks for nothing, so the unit's own timeout (TimeoutStartSec=,
        TimeoutStopSec=) ends it at most one window after its last request."""
        task = None
        if self.notifier.enabled:
            until = math.inf if budget_s is None else time.monotonic() + budget_s + STOP_GRACE_S
            task = asyncio.get_running_loop().create_task(self._extend(probe, until))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _extend(self, probe: Callable[[], Progress], until: float) -> None:
        last = probe()
        while True:
            await asyncio.sleep(EXTEND_EVERY_S)
            left = until - time.monotonic()
            if left <= 0:
                return  # the budget is spent: what the manager granted so far is all there is
            now = probe()
            if now.advanced_since(last):
                self.notifier.extend_timeout(min(EXTEND_WINDOW_S, left), now.status)
            else:
                self.notifier.status(f"{now.status} (no progress: no more time asked)")
            last = now

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        self.notifier.close()
