"""A synchronous cold tier for engines that decode in a thread: embedded, or through the daemon.

Both kinds answer the same three calls from the engine's thread: ``spill`` (clone
now, write behind; a future of the outcome), ``load`` (the longest usable prefix,
or None) and ``close``. Neither ever raises a spilld error into the engine: a
failure is logged and counted, and the engine goes on as if the tier missed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from .. import errors
from .. import format as fmt
from ..client import Client
from ..lease import RunStep
from ..loader import Loaded
from ..queue import Outcome, Settled
from ..spiller import Spiller

log = logging.getLogger("spilld.tier")

RECONNECT_INTERVAL_S = 5.0  # how often an engine retries an unreachable daemon


class ColdTier(Protocol):
    def spill(
        self, tokens: Sequence[int], caches: Sequence[Any], *, droppable: bool = True
    ) -> concurrent.futures.Future[Settled]: ...

    def load(self, tokens: Sequence[int]) -> Loaded | None: ...

    def close(self, timeout: float | None = None) -> None: ...


def settled_now(outcome: Outcome, error: BaseException | None = None) -> concurrent.futures.Future[Settled]:
    """A future already settled, for spills that never reached a queue."""
    f: concurrent.futures.Future[Settled] = concurrent.futures.Future()
    f.set_result(Settled(outcome, error=error))
    return f


class EmbeddedTier:
    """A ``Spiller`` on a private event-loop thread: no daemon, the engine's process writes the files."""

    def __init__(self, folder: str, identity: fmt.Identity, *, lease: RunStep | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="spilld-embedded", daemon=True)
        self._thread.start()
        self.spiller = Spiller(folder, identity=identity, lease=lease, **kwargs)
        self._run(self.spiller.start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def spill(
        self, tokens: Sequence[int], caches: Sequence[Any], *, droppable: bool = True
    ) -> concurrent.futures.Future[Settled]:
        try:
            f = self.spiller.spill(tokens, caches, droppable=droppable)
        except errors.SpillError as exc:  # e.g. a cache class no codec knows
            log.warning("spill refused: %s", exc)
            return settled_now(Outcome.FAILED, exc)
        assert isinstance(f, concurrent.futures.Future)  # called from the engine's thread
        return f

    def load(self, tokens: Sequence[int]) -> Loaded | None:
        result: Loaded | None = self._run(self.spiller.restore(tokens))
        return result

    def stats(self) -> dict[str, Any]:
        return self.spiller.stats()

    def close(self, timeout: float | None = None) -> None:
        try:
            self._run(self.spiller.close(timeout))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class DaemonTier:
    """The daemon's client, connected lazily: an unreachable daemon is a miss, retried now and then."""

    def __init__(self, socket_path: str | None, identity: fmt.Identity, **kwargs: Any) -> None:
        self.socket_path = socket_path
        self.identity = identity
        self.kwargs = kwargs
        self._client: Client | None = None
        self._next_try = 0.0
        self._connect()

    def _connect(self) -> Client | None:
        if self._client is not None or time.monotonic() < self._next_try:
            return self._client
        try:
            self._client = Client(self.socket_path, identity=self.identity, **self.kwargs)
        except errors.SpillError as exc:
            self._next_try = time.monotonic() + RECONNECT_INTERVAL_S
            log.warning("spilld daemon unreachable (%s); retrying in %.0f s", exc, RECONNECT_INTERVAL_S)
        return self._client

    def spill(
        self, tokens: Sequence[int], caches: Sequence[Any], *, droppable: bool = True
    ) -> concurrent.futures.Future[Settled]:
        client = self._connect()
        if client is None:
            return settled_now(Outcome.FAILED, errors.SpillError("the daemon is unreachable"))
        try:
            return client.spill(tokens, caches, droppable=droppable)
        except errors.SpillError as exc:
            log.warning("spill refused: %s", exc)
            return settled_now(Outcome.FAILED, exc)

    def load(self, tokens: Sequence[int]) -> Loaded | None:
        client = self._connect()
        if client is None:
            return None
        try:
            return client.load(tokens)
        except errors.SpillError as exc:  # a lost connection reconnects on the next call
            log.warning("cold-tier load failed: %s", exc)
            return None

    def stats(self) -> dict[str, Any]:
        client = self._connect()
        return client.status() if client is not None else {}

    def close(self, timeout: float | None = None) -> None:
        if self._client is not None:
            self._client.close(timeout)
            self._client = None
