"""The bounded write-behind queue of pushes: an offer never waits (when full, the oldest pushes are dropped); a
producer whose pushes must all land in order (an entry's chain of blocks) waits for room instead."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field

from .breaker import Work
from .keys import Kind

DEFAULT_QUEUE_ITEMS = 1024  # pushes waiting at most
DEFAULT_QUEUE_BYTES = 256 * 1024**2  # and their bytes at most: blocks of a large model are megabytes each


@dataclass(frozen=True)
class Push:
    namespace: str
    key: bytes
    data: bytes
    kind: Kind = Kind.BLOCK
    # the pieces of work it was offered in (``tier.one_failure``): a batch's failure counts towards those; None,
    # offered outside any: a failure of its own
    work: tuple[Work, ...] | None = field(default=None, compare=False)


class PushQueue:
    """A FIFO bounded by items and bytes. ``offer`` drops the oldest to make room (the newest prefixes are the
    likeliest to be asked for next) and never waits; ``take`` waits for the next batch."""

    def __init__(self, max_items: int = DEFAULT_QUEUE_ITEMS, max_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError("a push queue holds at least one item and one byte")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: deque[Push] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self._took = asyncio.Event()  # set whenever pushes leave the queue: room may have been made
        self._pending: Counter[tuple[str, bytes, Kind]] = Counter()  # queued or taken and not yet ``done``
        self.dropped = 0  # pushes dropped to make room for newer ones
        self.refused = 0  # pushes larger than the whole queue

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def fits(self, size: int) -> bool:
        """Whether a push of ``size`` bytes can be queued now without dropping one (an empty queue takes any push
        that ``offer`` would not refuse)."""
        return not self._items or (len(self._items) < self.max_items and self._bytes + size <= self.max_bytes)

    def pending(self, namespace: str, key: bytes, kind: Kind = Kind.BLOCK) -> bool:
        """A push of this value is queued, or taken and not yet ``done``: asking the tier for it would say absent."""
        return self._pending[(namespace, key, kind)] > 0

    def done(self, pushes: list[Push]) -> None:
        """Pushes taken are finished (written or failed)."""
        for p in pushes:
            self._forget(p)

    def _forget(self, p: Push) -> None:
        name = (p.namespace, p.key, p.kind)
        self._pending[name] -= 1
        if self._pending[name] <= 0:
            del self._pending[name]

    async def room(self) -> None:
        """Wait until some pushes leave the queue (taken or cleared)."""
        self._took.clear()
        await self._took.wait()

    def offer(self, push: Push) -> bool:
        """Queue ``push``, dropping the oldest while the queue is full; False when it alone exceeds the bound."""
        size = len(push.data)
        if size > self.max_bytes:
            self.refused += 1
            return False
        while self._items and (len(self._items) >= self.max_items or self._bytes + size > self.max_bytes):
            old = self._items.popleft()
            self._bytes -= len(old.data)
            self._forget(old)
            self.dropped += 1
        self._items.append(push)
        self._pending[(push.namespace, push.key, push.kind)] += 1
        self._bytes += size
        self._ready.set()
        return True

    def take_now(self, limit: int, max_bytes: int | None = None) -> list[Push]:
        """Up to ``limit`` of the oldest pushes, without waiting, holding at most ``max_bytes`` of data (the first
        push is taken whatever its size)."""
        out: list[Push] = []
        size = 0
        while self._items and len(out) < limit:
            if out and max_bytes is not None and size + len(self._items[0].data) > max_bytes:
                break
            push = self._items.popleft()
            self._bytes -= len(push.data)
            size += len(push.data)
            out.append(push)
        if not self._items:
            self._ready.clear()
        if out:
            self._took.set()
        return out

    async def take(self, limit: int, max_bytes: int | None = None) -> list[Push]:
        """The next batch of at most ``limit`` pushes and ``max_bytes`` (see ``take_now``), waiting for one when the
        queue is empty."""
        while not self._items:
            await self._ready.wait()
        return self.take_now(limit, max_bytes)

    def clear(self) -> int:
        """Drop every waiting push (the tier is disabled); returns how many."""
        n = len(self._items)
        for p in self._items:
            self._forget(p)
        self._items.clear()
        self._bytes = 0
        self._ready.clear()
        self._took.set()
        return n
