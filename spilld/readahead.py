"""Warm start: after a restart, the most recently used entries are read into the page cache at a bounded rate, so
that the first restores after a reboot read memory, not the disk.

The files are read (not only advised: ``posix_fadvise`` WILLNEED is a hint the kernel may drop, and cannot be
paced) in chunks on the low-priority background threads, paced to ``rate`` bytes a second on average, pausing while
``busy()`` says the daemon is serving (a restore or a write has the disk first). What is read is what a restore
of those entries would read: each entry's blocks, then its own file, newest use first, up to a byte budget.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import fileio
from .config import DEFAULT_WARM_RATE
from .lease import Pace, off_loop

if TYPE_CHECKING:
    from .store import Store

READ_CHUNK = 1024 * 1024  # bytes a read: small enough that pacing is smooth, large enough to be cheap
BUSY_POLL_S = 0.05  # how often a paused read-ahead looks again


def warm_order(store: Store, budget: int) -> list[tuple[str, int]]:
    """The files to read: for each entry, most recently used first, its blocks not listed yet, then its own
    file; until ``budget`` bytes are listed (a file that would pass it ends the list)."""
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    total = 0
    for e in sorted(store.entries, key=lambda e: e.last_used, reverse=True):
        files = [(p, n) for k in e.blocks if (p := store.block_path(k)) is not None and (n := store.block_bytes(k))]
        files.append((e.path, e.nbytes))
        for path, n in files:
            if path in seen:
                continue
            if total + n > budget:
                return out
            seen.add(path)
            out.append((path, n))
            total += n
    return out


@dataclass
class ReadAheadStats:
    planned_bytes: int = 0
    read_bytes: int = 0
    files: int = 0
    done: bool = False


class ReadAhead:
    """Reads ``files`` into the page cache at ``rate`` bytes a second (``run``); ``stats`` for ``status``."""

    def __init__(
        self,
        files: Iterable[tuple[str, int]],
        rate: int = DEFAULT_WARM_RATE,
        busy: Callable[[], bool] = lambda: False,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError("the read-ahead rate must be positive")
        self.files = list(files)
        self.rate, self.busy, self.clock, self.sleep = rate, busy, clock, sleep
        self.stats = ReadAheadStats(planned_bytes=sum(n for _, n in self.files))

    async def run(self) -> None:
        buf = bytearray(READ_CHUNK)
        pace = Pace(self.rate, self.busy, self.clock, self.sleep, BUSY_POLL_S)
        at = _Cursor()
        while at.index < len(self.files):
            await pace.wait_idle()
            # about a chunk's bytes a call, on a worker (no file call on the loop): a piece of a large file, or
            # many small ones, so that a store of small files costs few loop turns
            n, files = await off_loop(functools.partial(_read_some, self.files, at, buf), idle=True)
            self.stats.read_bytes += n
            self.stats.files += files
            await pace.took(n)
        self.stats.done = True


@dataclass
class _Cursor:
    index: int = 0  # the file being read
    offset: int = 0  # bytes of it read


def _read_some(files: list[tuple[str, int]], at: _Cursor, buf: bytearray) -> tuple[int, int]:
    """Read on from ``at`` until ``len(buf)`` bytes are read or the files end: (bytes read, files finished with
    at least a byte read). A file gone (evicted since it was listed) or unreadable is passed over."""
    total = files_done = 0
    while at.index < len(files) and total < len(buf):
        try:
            fd = fileio.open_regular(files[at.index][0], os.O_NOFOLLOW)  # no FIFO, no link: the store's own files only
        except OSError:
            at.index, at.offset = at.index + 1, 0
            continue
        try:
            while total < len(buf):
                n = os.preadv(fd, [memoryview(buf)[: len(buf) - total]], at.offset)
                if n <= 0:
                    break
                at.offset += n
                total += n
        except OSError:
            n = 0
        finally:
            os.close(fd)
        if total >= len(buf) and n > 0:
            break  # the chunk is full mid-file: go on from here next time
        files_done += at.offset > 0
        at.index, at.offset = at.index + 1, 0
    return total, files_done
