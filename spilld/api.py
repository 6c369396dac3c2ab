"""The one API of the three ways in: ``Spiller`` (in-process), ``AsyncClient`` and ``Client`` (the daemon).

The two asyncio ones satisfy ``AsyncTier``; ``Client`` is its synchronous mirror, ``SyncTier``. Same method
names, same parameters, same typed results:

- ``spill(...)``: clones (or plans a live snapshot) on the caller's thread and returns at once with a future of a
  ``Settled`` (its ``value`` a ``SaveResult`` once stored). ``Spiller``/``AsyncClient``: an ``asyncio.Future``,
  called on their event loop's thread (an engine that decodes in another thread uses ``spill_threadsafe``,
  a ``concurrent.futures.Future``); ``Client``: a ``concurrent.futures.Future``, from any thread. A spill of no
  token or no cache raises ``BadParams`` at the call; one whose token ids are not u32 ints settles failed with it.
  ``behind=`` names an earlier droppable spill of the same entry (a write-behind) kept in its place where it can be.
- ``lookup(tokens, namespace)``: ``Hit | Miss``, without reading the file.
- ``load(tokens, namespace, *, longer_than=0)``: the longest usable prefix as ``Loaded`` (cut to the match), or
  None (also when it holds no more than ``longer_than`` tokens: the engine has that much in memory). A read past
  its deadline (a hung disk) raises ``StorageTimeout``; a lookup a hung daemon does not answer, ``Timeout``.
- ``barrier(key)``: a future that settles once every spill queued before it is settled (in process, ``Spiller``
  also takes an ``action`` to run then).
- ``checkpoint(tokens, caches, checkpoint)``, ``resume(key)``, ``finish(key)``: an in-flight generation's
  checkpoints: a newer one cancels the older ones still queued; ``resume`` loads the latest durable one (None if
  none); ``finish`` cancels the generation's queued work (its checkpoints, and spills given its key) and deletes
  its stored checkpoints (a future, its value how many). A generation's key is the daemon's, shared by its clients:
  make it unique (a request id).
- ``cancel(namespace=, key=)``: queued items of a namespace and/or key dropped (not one being written); how many.
- ``status()``: a dict with ``queue`` and ``store`` counters (the daemon's has much more).
- ``drain(timeout)`` / ``close(timeout)``: a ``DrainReport``; ``timeout`` bounds the whole call.

To start: ``await Spiller.open(folder, ...)`` / ``await AsyncClient.open(socket, ...)``, or ``async with``
either; ``Client(socket, ...)`` connects in its constructor (``with Client(...)`` closes it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .entries import Miss, MissReason
from .format import GenerationCheckpoint

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .loader import Loaded
    from .queue import DrainReport, Settled
    from .saver import Attachment
    from .snapshot import AnyFuture
    from .spiller import Spiller

__all__ = ["AsyncTier", "Hit", "Miss", "MissReason", "SyncTier"]


@dataclass(frozen=True)
class Hit:
    """A usable prefix: ``matched`` tokens of the file at ``path`` (which holds ``tokens``) can be restored."""

    path: str
    matched: int
    tokens: int
    trimmable: bool
    blocks_only: bool = False  # the prefix is restored from the entry's blocks alone (another conversation's)


class AsyncTier(Protocol):
    """What ``Spiller`` and ``AsyncClient`` both offer (see the module's docstring)."""

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        namespace: str = "",
        key: str = "",
        droppable: bool = True,
        attachments: Sequence[Attachment] = (),
        checkpoint: GenerationCheckpoint | None = None,
        live: bool = False,
        pin: bool = False,
        behind: AnyFuture | None = None,
    ) -> asyncio.Future[Settled]: ...

    async def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit | Miss: ...

    async def load(self, tokens: Sequence[int], namespace: str = "", *, longer_than: int = 0) -> Loaded | None: ...

    def barrier(self, key: str = "") -> asyncio.Future[Settled]: ...

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoint: GenerationCheckpoint,
        *,
        attachments: Sequence[Attachment] = (),
    ) -> asyncio.Future[Settled]: ...

    async def resume(self, key: str) -> Loaded | None: ...

    def finish(self, key: str) -> asyncio.Future[Settled]: ...

    async def cancel(self, *, namespace: str | None = None, key: str | None = None) -> int: ...

    async def status(self) -> dict[str, Any]: ...

    async def drain(self, timeout: float | None = None) -> DrainReport: ...

    async def close(self, timeout: float | None = None) -> DrainReport: ...


class SyncTier(Protocol):
    """``Client``: the same calls, synchronous (``spill`` gives a ``concurrent.futures.Future``)."""

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        namespace: str = "",
        key: str = "",
        droppable: bool = True,
        attachments: Sequence[Attachment] = (),
        checkpoint: GenerationCheckpoint | None = None,
        live: bool = False,
        pin: bool = False,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled]: ...

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit | Miss: ...

    def load(self, tokens: Sequence[int], namespace: str = "", *, longer_than: int = 0) -> Loaded | None: ...

    def barrier(self, key: str = "") -> concurrent.futures.Future[Settled]: ...

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoint: GenerationCheckpoint,
        *,
        attachments: Sequence[Attachment] = (),
    ) -> concurrent.futures.Future[Settled]: ...

    def resume(self, key: str) -> Loaded | None: ...

    def finish(self, key: str) -> concurrent.futures.Future[Settled]: ...

    def cancel(self, *, namespace: str | None = None, key: str | None = None) -> int: ...

    def status(self) -> dict[str, Any]: ...

    def drain(self, timeout: float | None = None) -> DrainReport: ...

    def close(self, timeout: float | None = None) -> DrainReport: ...


if TYPE_CHECKING:

    def _conforms(s: Spiller, a: AsyncClient, c: Client) -> tuple[AsyncTier, AsyncTier, SyncTier]:
        """mypy checks that the three ways in satisfy their protocol (never called)."""
        return s, a, c


class Deadline:
    """One deadline for a call made of several waits: each wait gets what is left, never the whole timeout again."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else asyncio.get_running_loop().time() + max(0.0, timeout)

    def left(self) -> float | None:
        if self._end is None:
            return None
        return max(0.0, self._end - asyncio.get_running_loop().time())

    def within(self, most: float) -> float:
        """``most`` seconds, or what is left if less: a wait of its own that the call's timeout still bounds."""
        left = self.left()
        return most if left is None else min(most, left)
