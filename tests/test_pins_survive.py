"""Pins survive what this process's index does not show: an entry a scan could not read, another writer's pins.

Found in review: every pins write rewrote ``.spilld-pins`` from the writer's own index, so a pinned entry the scan
skipped (EIO, EMFILE) lost its pin at the next unrelated pin change and was then superseded, and a Spiller guest's
pin erased the owner's from the shared file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import errors, fileio
from spilld.store import Store
from spilld.store.pins import PINS_FILE, read_pins
from tests.caches import fill

IDENT = spilld.Identity("pins", "cfg", "tok", "")


def caches(n: int, seed: int = 0) -> list[C.KVCache]:
    return [fill(C.KVCache(), n, seed=seed + i) for i in range(2)]


def store(root: Path) -> Store:
    return Store(root, disk_cap=2**40, block_tokens=16)


def owner(root: Path) -> Store:
    s = store(root)
    s.acquire()
    s.scan()
    return s


@pytest.mark.asyncio
async def test_a_pin_the_scan_could_not_read_survives_another_pin_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spilld.store import scan as scanning

    s = owner(tmp_path)
    system = list(range(40))
    p = await s.put(system, caches(40), IDENT, pin=True)  # a shared system prompt
    q = await s.put(list(range(900, 920)), caches(20, seed=5), IDENT, pin=True)
    s.close()
    real = scanning.read_own_header

    def header(path: str, *args: Any, **kw: Any) -> Any:
        if path == p.path:  # unreadable at this start only: the scan leaves the file alone
            raise errors.StorageError("read failed: Input/output error", path=path)
        return real(path, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(scanning, "read_own_header", header)
        flaky = owner(tmp_path)
    assert flaky.entry_at(p.path) is None and os.path.exists(p.path)
    assert await flaky.pin_async(q.path, on=False)  # an unrelated change rewrites the file
    assert flaky.pin(q.path) and flaky.pin(q.path, on=False)  # and the blocking one too
    assert read_pins(str(tmp_path)) == [p.path]
    flaky.close()

    again = owner(tmp_path)  # the file reads again: still pinned, so never superseded
    e = again.entry_at(p.path)
    assert e is not None and again.is_pinned(e) and again.stats()["pinned"] == 1
    await again.put([*system, 7, 8], caches(42), IDENT)  # its next turn extends it
    assert again.entry_at(p.path) is not None and again.counters.superseded == 0


@pytest.mark.asyncio
async def test_two_writers_of_a_folder_keep_each_others_pins_and_unpins(tmp_path: Path) -> None:
    main = owner(tmp_path)
    p = await main.put(list(range(40)), caches(40), IDENT, pin=True)
    guest = store(tmp_path)  # the owner holds the lock: a Spiller's guest, which reaps nothing
    guest.scan()
    seen = guest.entry_at(p.path)
    assert not guest.lock.held and seen is not None and guest.is_pinned(seen)
    g = await guest.put(list(range(500, 540)), caches(40, seed=3), IDENT, pin=True)
    r = await main.put(list(range(700, 740)), caches(40, seed=7), IDENT, pin=True)
    assert sorted(read_pins(str(tmp_path))) == sorted([p.path, g.path, r.path])
    assert await main.pin_async(p.path, on=False)
    h = await guest.put(list(range(300, 340)), caches(40, seed=9), IDENT, pin=True)  # its stale p stays unpinned
    assert sorted(read_pins(str(tmp_path))) == sorted([g.path, r.path, h.path])
    main.close()

    again = owner(tmp_path)
    pinned = {e.path for e in again.entries if again.is_pinned(e)}
    assert pinned == {g.path, r.path, h.path}


@pytest.mark.asyncio
async def test_a_removed_entry_leaves_the_pins_file_at_the_next_write(tmp_path: Path) -> None:
    s = owner(tmp_path)
    p = await s.put(list(range(40)), caches(40), IDENT, pin=True)
    q = await s.put(list(range(900, 940)), caches(40, seed=5), IDENT)
    gone = str(tmp_path / "f" / "n" / "gone.spilld")  # named by a writer that removed it and wrote no pins since
    (tmp_path / PINS_FILE).write_text(f"{os.path.relpath(p.path, tmp_path)}\nf/n/gone.spilld\n")
    assert await s.remove_where_async(lambda e: e.path == p.path) == 1  # removed here: its pin goes
    assert await s.pin_async(q.path)
    assert read_pins(str(tmp_path)) == [q.path] and gone not in read_pins(str(tmp_path))


class SlowFirstPinsRename(fileio.FileOps):
    """The first rename of the pins file takes 0.5 s (a busy disk), past a 0.1 s I/O deadline."""

    def __init__(self) -> None:
        self.renames = 0

    def rename(self, src: str, dst: str) -> None:
        if dst.endswith(PINS_FILE):
            self.renames += 1
            if self.renames == 1:
                time.sleep(0.5)
        super().rename(src, dst)


@pytest.mark.asyncio
async def test_a_pins_write_past_its_deadline_never_lands_over_a_later_one(tmp_path: Path) -> None:
    """Found in review: a pins write past --io-timeout went on in its thread and renamed its older set over the
    next write's, which had cleared its changes as written: B's pin was gone from the file, and after a restart."""
    s = Store(tmp_path, disk_cap=2**30, durability="none", ops=SlowFirstPinsRename(), io_timeout=0.1)
    s.scan()
    a = (await s.put(list(range(100, 108)), [fill(C.KVCache(), 8)], IDENT)).path
    b = (await s.put(list(range(200, 208)), [fill(C.KVCache(), 8, seed=1)], IDENT)).path
    with pytest.raises(errors.StorageTimeout):
        await s.pin_async(a)
    with contextlib.suppress(errors.StorageTimeout):  # (it waits for the late write, past its own deadline too)
        await s.pin_async(b)
    await asyncio.sleep(1.0)  # the late writes land
    s.close()
    again = Store(tmp_path, disk_cap=2**30)
    again.scan()
    assert {p for p in (a, b) if (e := again.entry_at(p)) is not None and again.is_pinned(e)} == {a, b}
