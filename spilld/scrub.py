"""The scrub: an idle-time, rate-limited check of every stored file, so that a file the disk corrupted is found
(and moved aside) before a restore needs it, not by it.

Each pass lists the store's files (blocks, manifests, whole entries) and checks each one whole (header, rules,
every tensor hash) on a low-priority thread, paced to ``rate`` bytes a second on average, pausing while the daemon
is serving (``busy()``). A bad file is quarantined through the store (a bad block takes every entry naming it); a
file gone from the disk leaves the index the same way.
Passes start at most every ``interval`` seconds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from . import errors, fileio
from .config import DEFAULT_SCRUB_INTERVAL_S, DEFAULT_SCRUB_RATE
from .lease import Pace, off_loop
from .loader import verify_steps
from .store import Store
from .validate import check_file_bytes

log = logging.getLogger("spilld.scrub")

FIRST_AFTER_S = 600.0  # the first pass waits this long after a start (or one interval, if shorter): boot is busy
IN_MEMORY_MAX = 64 * 1024 * 1024  # a manifest at most this large is read whole and checked in memory
BUSY_POLL_S = 0.2  # how often a paused scrub looks again


@dataclass
class ScrubStats:
    passes: int = 0  # passes finished
    files: int = 0  # files checked in the current pass
    bytes: int = 0  # bytes checked in the current pass
    planned_files: int = 0  # files listed for the current pass
    bad: int = 0  # files found bad and quarantined, all passes
    unreadable: int = 0  # files still stored that could not be read (EIO, a hung disk), all passes
    gone: int = 0  # files the store indexed that were gone from the disk, taken out of the index, all passes
    paused: bool = False  # waiting for the daemon to be idle


def check_manifest(path: str) -> bool:
    """A manifest of at most ``IN_MEMORY_MAX`` bytes read whole and checked in memory, without its blocks (they are
    checked as files of their own); False, nothing checked, if it is larger (then it is checked in paced steps)."""
    with open(fileio.open_regular(path, os.O_NOFOLLOW), "rb") as f:  # no FIFO (it would block), no link
        data = f.read(IN_MEMORY_MAX + 1)  # (never more than the bound, whatever the file's size says meanwhile)
    if len(data) > IN_MEMORY_MAX:
        return False
    check_file_bytes(data, path)
    return True


class Scrub:
    """``run`` scrubs ``store`` forever (cancel it to stop); ``stats`` for ``status``."""

    def __init__(
        self,
        store: Store,
        rate: int = DEFAULT_SCRUB_RATE,
        busy: Callable[[], bool] = lambda: False,
        *,
        interval: float = DEFAULT_SCRUB_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0 or interval < 0:
            raise ValueError("the scrub's rate must be positive and its interval not negative")
        self.store, self.rate, self.busy, self.interval = store, rate, busy, interval
        self.clock, self.sleep = clock, sleep
        self.stats = ScrubStats()

    def targets(self) -> list[tuple[str, int, bool]]:
        """Every file of the store now: (path, bytes, whether it is a manifest with blocks)."""
        out = [(b.path, b.nbytes, False) for b in self.store.blocks]
        return out + [(e.path, e.nbytes, bool(e.blocks)) for e in self.store.entries]

    async def run(self) -> None:
        await self.sleep(min(FIRST_AFTER_S, self.interval))
        while True:
            began = self.clock()
            await self.scrub_pass()
            wait = began + self.interval - self.clock()
            if wait > 0:
                await self.sleep(wait)

    async def scrub_pass(self) -> None:
        files = await off_loop(self.targets, compute=True)  # a million blocks: ~0.3 s, never on the loop (review)
        st = self.stats
        st.files, st.bytes, st.planned_files = 0, 0, len(files)
        pace = Pace(self.rate, self.busy, self.clock, self.sleep, BUSY_POLL_S, self._paused)
        for path, nbytes, has_blocks in files:
            await pace.wait_idle()
            whole = False  # checked in one call (a manifest's tail: small), paced on its size after
            try:
                if has_blocks and nbytes <= IN_MEMORY_MAX:
                    whole = await off_loop(functools.partial(check_manifest, path), idle=True)
                if not whole:  # a chunk a worker call, paced and yielding to serving between two (found in review:
                    await self._check_in_steps(path, nbytes, pace)  # a whole file at disk speed, busy or not)
            except errors.FileFormatError as exc:
                if await self.store.found_bad_async(path, exc):
                    st.bad += 1
            except (errors.SpillError, OSError) as exc:  # gone (evicted, superseded), or unreadable now
                if not self.store.holds(path):  # not the store's any more: listed, and nothing read
                    st.files += 1
                    continue
                if await self.store.lost_async(path):  # removed from under the store (found in review: counted
                    st.gone += 1  # unreadable each pass, and its entries stayed hits that no client could read)
                    st.files += 1
                    log.warning("scrub: %s is gone from the disk: taken out of the store", path)
                    continue
                st.unreadable += 1  # an unreadable sector is what a scrub is for: said (found in review: hidden)
                log.warning("scrub: %s could not be read: %s", path, exc)
            st.files += 1
            st.bytes += nbytes
            if whole:
                await pace.took(nbytes)  # paced on the pass's total, less its pauses (a file in steps: each step)
        st.passes += 1

    async def _check_in_steps(self, path: str, nbytes: int, pace: Pace) -> None:
        steps, read = verify_steps(path, fileio.OWN_OPS), 0
        try:
            while (n := await off_loop(functools.partial(next, steps, -1), idle=True)) >= 0:
                read += n
                await pace.took(n)
                await pace.wait_idle()
        finally:
            await off_loop(steps.close, idle=True)  # its file closed on a worker: never on the loop
        await pace.took(max(0, nbytes - read))  # its header and padding, read too

    def _paused(self, paused: bool) -> None:
        self.stats.paused = paused
