"""Background readers that must never compete with serving: the warm start after a restart (read-ahead of the
newest entries at a bounded rate) and the scrub (every stored file checked in idle time, bad ones moved aside)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
from spilld.daemon.server import BUSY_AFTER_LOOKUP_S
from spilld.readahead import READ_CHUNK, ReadAhead, warm_order
from spilld.scrub import Scrub
from spilld.store import Store
from tests.caches import fill
from tests.daemons import Daemon, cleanup, new_root
from tests.test_store import flip

IDENT = spilld.Identity("background")


class FakeTime:
    """A clock that moves only when slept on: pacing checked without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def caches(n: int, seed: int = 0) -> list[C.KVCache]:
    return [fill(C.KVCache(), n, seed=seed + i) for i in range(2)]


@pytest.mark.asyncio
async def test_warm_order_reads_the_newest_entries_blocks_first_within_the_budget(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    shared = list(range(32))
    for i in range(3):
        await s.put([*shared, *range(100 * (i + 1), 100 * (i + 1) + 20)], caches(52, seed=i), IDENT)
    entries = sorted(s.entries, key=lambda e: e.last_used)
    for k, e in enumerate(entries):
        e.last_used = 1000.0 + k  # the last put is the newest
    newest = entries[-1]
    order = warm_order(s, 2**40)
    blocks = [s.block_path(k) for k in newest.blocks]
    assert [p for p, _ in order[: len(blocks) + 1]] == [*blocks, newest.path]
    assert len(order) == len({p for p, _ in order})  # a shared block is read once
    assert {p for p, _ in order} == {p for e in entries for p in [e.path, *map(s.block_path, e.blocks)]}
    budget = sum(n for _, n in order[:3])
    assert warm_order(s, budget) == order[:3] and warm_order(s, budget - 1) == order[:2]
    assert warm_order(s, 0) == []


@pytest.mark.asyncio
async def test_the_read_ahead_reads_every_byte_at_its_rate_and_waits_while_busy(tmp_path: Path) -> None:
    files = []
    for i, size in enumerate((3 * READ_CHUNK + 5, READ_CHUNK, 17)):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(size))
        files.append((str(p), size))
    files.append((str(tmp_path / "gone"), 100))  # evicted since it was listed: skipped
    t = FakeTime()
    busy = [3]  # busy for the first three looks

    def is_busy() -> bool:
        busy[0] -= 1
        return busy[0] >= 0

    rate = 2 * READ_CHUNK  # bytes a second
    ra = ReadAhead(files, rate, is_busy, clock=t.clock, sleep=t.sleep)
    await ra.run()
    total = sum(n for _, n in files[:3])
    assert ra.stats.read_bytes == total and ra.stats.files == 3 and ra.stats.done
    paused = 2 * 0.05  # the first look saw it busy, then two polls
    assert t.slept[:2] == [0.05, 0.05] and t.slept[2] > 0.05  # waited while busy, before reading anything
    assert t.now == pytest.approx(paused + total / rate)  # the pace: never faster than the rate, pauses aside


def test_a_daemon_warms_its_newest_entries_after_a_restart() -> None:
    d = Daemon(new_root(), ["--cap", "64MiB", "--durability", "none", "--block-tokens", "16"]).start()
    try:
        with spilld.Client(d.socket, identity=IDENT, name="warm") as client:
            for i in range(3):
                assert client.spill(list(range(i * 100, i * 100 + 40)), caches(40, seed=i)).result(60).stored
        assert d.stop() == 0
        d.start("--warm-rate", "1MiB")
        deadline = time.monotonic() + 30
        while True:
            with spilld.Client(d.socket, identity=IDENT, name="warm") as client:
                st = client.status()
            if st["warm"]["done"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        w = st["warm"]
        assert w["done"] and w["read_bytes"] == w["planned_bytes"] == st["store"]["bytes"] and w["files"] == 3 + 6
        out = d.cli("status", "--socket", d.socket)
        assert "warm    read" in out.stdout and "done" in out.stdout
        d.stop()
        d.start("--warm-bytes", "0")
        with spilld.Client(d.socket, identity=IDENT, name="warm") as client:
            assert "warm" not in client.status()
    finally:
        d.stop()
        cleanup(d.root)


async def three_conversations(root: Path) -> tuple[Store, list[list[int]]]:
    s = Store(root, disk_cap=2**40, block_tokens=16)
    convs = [[*range(32), *range(100 * (i + 1), 100 * (i + 1) + 20)] for i in range(3)]  # 2 shared blocks each
    for i, t in enumerate(convs):
        await s.put(t, caches(len(t), seed=i), IDENT)
    return s, convs


def quarantined(root: Path) -> list[str]:
    q = root / ".quarantine"
    return sorted(os.listdir(q)) if q.exists() else []


@pytest.mark.asyncio
async def test_a_scrub_pass_moves_a_bad_block_aside_with_the_entries_naming_it(tmp_path: Path) -> None:
    s, convs = await three_conversations(tmp_path)
    by_last = {int(e.tokens[-1]): e for e in s.entries}
    first, second, third = (by_last[c[-1]] for c in convs)
    own = s.block_path(first.blocks[2])  # the first conversation's own block (0 and 1 are shared)
    assert own is not None
    flip(own, os.path.getsize(own) - 3)  # the last bytes of its last tensor
    flip(second.path, os.path.getsize(second.path) - 3)  # the second one's manifest (its tail)
    t = FakeTime()
    scrub = Scrub(s, 2**40, clock=t.clock, sleep=t.sleep)
    await scrub.scrub_pass()
    assert scrub.stats.bad == 2 and scrub.stats.passes == 1 and scrub.stats.files == scrub.stats.planned_files
    assert [e.path for e in s.entries] == [third.path]  # the bad block took the entry naming it
    assert len(quarantined(tmp_path)) == 2 and not os.path.exists(own)
    got = s.restore(s.lookup(IDENT, "", [*convs[2], 1]), IDENT)  # type: ignore[arg-type]
    assert isinstance(got, spilld.Loaded) and got.tokens == convs[2]
    await scrub.scrub_pass()  # nothing left to find
    assert scrub.stats.bad == 2 and scrub.stats.planned_files == len(s.blocks) + 1


@pytest.mark.asyncio
async def test_a_scrub_of_good_files_changes_nothing_and_keeps_its_rate(tmp_path: Path) -> None:
    s, _ = await three_conversations(tmp_path)
    before = sorted(os.listdir(tmp_path))
    t = FakeTime()
    busy = [True, True, False]
    scrub = Scrub(s, 1024 * 1024, lambda: busy.pop(0) if busy else False, clock=t.clock, sleep=t.sleep)
    await scrub.scrub_pass()
    total = sum(n for _, n, _ in scrub.targets())
    assert scrub.stats.bad == 0 and scrub.stats.bytes == total and s.count == 3
    assert sorted(os.listdir(tmp_path)) == before and quarantined(tmp_path) == []
    assert t.slept[0] == 0.2  # paused while the daemon served, before the first file
    assert t.now == pytest.approx(0.2 + total / (1024 * 1024))  # never faster than its rate


def test_a_daemon_scrubs_in_idle_time_and_status_shows_it() -> None:
    d = Daemon(new_root(), ["--cap", "64MiB", "--durability", "none", "--block-tokens", "16"]).start()
    try:
        with spilld.Client(d.socket, identity=IDENT, name="scrub") as client:
            for i in range(2):
                assert client.spill(list(range(i * 100, i * 100 + 40)), caches(40, seed=i)).result(60).stored
        assert d.stop() == 0
        block = next(p for p in Path(d.dir).rglob("*.spilld-block"))
        flip(str(block), block.stat().st_size - 3)
        d.start("--scrub-every", "1s", "--warm-bytes", "0")
        deadline = time.monotonic() + 30
        while True:
            with spilld.Client(d.socket, identity=IDENT, name="scrub") as client:
                st = client.status()
            if st["scrub"]["passes"] >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert st["scrub"]["bad"] == 1 and st["store"]["entries"] == 1 and st["store"]["quarantined"] == 1
        out = d.cli("status", "--socket", d.socket)
        assert "1 bad files found" in out.stdout, out.stdout
    finally:
        d.stop()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_a_scrub_counts_and_says_a_stored_file_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: a file the scrub could not read (EIO) counted as checked, with nothing said or counted,
    every pass; a file gone meanwhile (evicted) is not the store's any more and counts as nothing."""
    from spilld import errors
    from spilld import scrub as scrub_module

    s, _ = await three_conversations(tmp_path)
    unreadable = s.block_path(s.entries[0].blocks[2])
    gone = str(tmp_path / "evicted-meanwhile.spilld")
    real = scrub_module.verify_steps

    def steps(path: str, ops: Any = None) -> Any:
        if path == unreadable:
            raise errors.StorageError("read failed: Input/output error", path=path)
        if path == gone:
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(scrub_module, "verify_steps", steps)
    t = FakeTime()
    scrub = Scrub(s, 2**40, clock=t.clock, sleep=t.sleep)
    listed = scrub.targets()
    monkeypatch.setattr(scrub, "targets", lambda: [*listed, (gone, 100, False)])
    with caplog.at_level("WARNING", logger="spilld.scrub"):
        await scrub.scrub_pass()
    st = scrub.stats
    assert (st.unreadable, st.bad, st.files, st.planned_files) == (1, 0, len(listed) + 1, len(listed) + 1)
    assert st.bytes == sum(n for _, n, _ in listed)  # the file gone meanwhile: nothing read
    assert any(unreadable in r.getMessage() for r in caplog.records)
    assert s.count == 3  # an unreadable file is not taken for a bad one: it stays


@pytest.mark.asyncio
async def test_a_scrub_yields_to_a_busy_daemon_inside_a_file_and_paces_each_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a file was checked whole in one worker call, at disk speed, a client busy or not; it is now
    checked a chunk a call, paced and yielding between two."""
    from spilld import loader
    from spilld import scrub as scrub_module

    s, _ = await three_conversations(tmp_path)
    monkeypatch.setattr(loader, "VERIFY_CHUNK", 1024)  # a block file is several chunks
    busy = {"now": False, "files": 0, "came": False}
    real = scrub_module.verify_steps

    def steps(path: str, ops: Any = None) -> Any:
        def wrapped() -> Any:
            gen = real(path)
            try:
                while True:
                    n = next(gen)
                    if not busy["came"]:  # a client arrives once, during the first file's check
                        busy["now"] = busy["came"] = True
                    yield n
            except StopIteration as stop:
                busy["files"] += 1
                busy["now"] = False  # and is gone when that file is done
                return stop.value

        return wrapped()

    monkeypatch.setattr(scrub_module, "verify_steps", steps)
    t = FakeTime()

    async def sleep(s_: float) -> None:
        if s_ == scrub_module.BUSY_POLL_S:  # the client's work ends while the scrub waits for it
            busy["now"] = False
        await t.sleep(s_)

    rate = 64 * 1024
    scrub = Scrub(s, rate, lambda: busy["now"], clock=t.clock, sleep=sleep)
    await scrub.scrub_pass()
    assert 0.2 in t.slept and busy["files"] == len(s.blocks)  # paused inside the first file, then went on
    assert t.now == pytest.approx(0.2 + scrub.stats.bytes / rate, rel=0.05)  # and kept its rate


@pytest.mark.asyncio
async def test_a_scrub_lists_the_store_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a pass listed every file of the store on the event loop (about 0.3 s at a million blocks)."""
    import threading

    s, _ = await three_conversations(tmp_path)
    t = FakeTime()
    scrub = Scrub(s, 2**40, clock=t.clock, sleep=t.sleep)
    real, where = scrub.targets, []

    def targets() -> Any:
        where.append(threading.current_thread())
        return real()

    monkeypatch.setattr(scrub, "targets", targets)
    await scrub.scrub_pass()
    assert where and where[0] is not threading.current_thread() and scrub.stats.files == scrub.stats.planned_files


def _fifo_in_place_of(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def _link_in_place_of(path: str) -> None:
    """The same bytes, moved beside the store and linked back under the name: only the link is wrong."""
    theirs = path + ".theirs"
    os.rename(path, theirs)
    os.symlink(theirs, path)


@pytest.mark.asyncio
@pytest.mark.parametrize("swap", [_fifo_in_place_of, _link_in_place_of], ids=["fifo", "link"])
async def test_a_fifo_or_link_named_like_a_stored_file_is_refused_by_the_scrub_and_the_warm_start(
    tmp_path: Path, swap: Any
) -> None:
    """Found in review: the scrub and the warm start opened store files in blocking mode, so a FIFO put in place of
    a manifest hung a background thread (and a daemon's stop, which waited for it); and both read through a link
    put in place of one. Both now refuse either at once."""
    import asyncio

    s, _ = await three_conversations(tmp_path)
    manifest = s.entries[0].path
    swap(manifest)
    t = FakeTime()
    scrub = Scrub(s, 2**40, clock=t.clock, sleep=t.sleep)
    await asyncio.wait_for(scrub.scrub_pass(), 10)
    assert scrub.stats.unreadable == 1 and scrub.stats.files == scrub.stats.planned_files
    files = [(manifest, 4096), *((p, n) for p, n, _ in scrub.targets() if p != manifest)]
    ra = ReadAhead(files, 2**40, lambda: False, clock=t.clock, sleep=t.sleep)
    await asyncio.wait_for(ra.run(), 10)
    assert ra.stats.done and ra.stats.files == len(files) - 1  # the FIFO or link passed over, every other file read


@pytest.mark.asyncio
async def test_a_manifest_larger_than_the_in_memory_bound_is_scrubbed_in_paced_steps_without_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a manifest over IN_MEMORY_MAX (a sliding-window model's, stored whole in it) was checked in
    one worker call with every block it names, unpaced: 137.9 MiB read for a 65.8 MiB manifest, the pace told
    65.8. It is checked in steps now, as any file, and its blocks only as files of their own."""
    from spilld import scrub as scrub_module

    s, _ = await three_conversations(tmp_path)
    monkeypatch.setattr(scrub_module, "IN_MEMORY_MAX", 64)  # every manifest is "large" here
    stepped: list[str] = []
    real = scrub_module.verify_steps

    def steps(path: str, ops: Any = None) -> Any:
        stepped.append(path)
        return real(path)

    monkeypatch.setattr(scrub_module, "verify_steps", steps)
    t = FakeTime()
    rate = 1024 * 1024
    scrub = Scrub(s, rate, clock=t.clock, sleep=t.sleep)
    await scrub.scrub_pass()
    listed = scrub.targets()
    assert sorted(stepped) == sorted(p for p, _, _ in listed)  # each file once: no block read again with a manifest
    assert scrub.stats.bytes == sum(n for _, n, _ in listed) and scrub.stats.bad == 0
    assert t.now == pytest.approx(scrub.stats.bytes / rate)  # paced on what it read, once


@pytest.mark.asyncio
async def test_the_scan_never_indexes_a_fifo_named_like_a_block(tmp_path: Path) -> None:
    """Found in review: a FIFO named like a block was indexed by its name and size; its prefix was then never
    served again (every restore an io_error, nothing quarantined, and a new put reused it instead of writing it)."""
    s, _ = await three_conversations(tmp_path)
    e = s.entries[0]
    block = s.block_path(e.blocks[2])  # its own block (0 and 1 are shared)
    assert block is not None
    _fifo_in_place_of(block)
    tokens = [int(t) for t in e.tokens]
    again = Store(tmp_path, disk_cap=2**40, block_tokens=16)  # a restart: the index rebuilt from the files
    assert again.scan() == 2 and e.blocks[2] not in {b.key for b in again.blocks}  # (its manifest names a gap)
    await again.put(tokens, caches(len(tokens), seed=9), IDENT)  # the block is written anew, beside the FIFO
    assert again.block_path(e.blocks[2]) not in (None, block)
    got = again.restore(again.lookup(IDENT, "", [*tokens, 1]), IDENT)  # type: ignore[arg-type]
    assert isinstance(got, spilld.Loaded) and got.tokens == tokens


@contextlib.asynccontextmanager
async def _a_stored_entry() -> AsyncIterator[tuple[Any, Any, list[int]]]:
    """An in-process daemon (blocks of 16 tokens, --io-timeout 30 s), a client of it, and the 40 tokens of an entry
    that client stored."""
    from spilld.client import AsyncClient
    from spilld.daemon import Daemon as InProcess
    from tests.daemons import quiet_config

    root = new_root()
    daemon = InProcess(quiet_config(root, block_tokens=16, io_timeout=30))
    await daemon.start()
    try:
        async with AsyncClient(daemon.cfg.socket, identity=spilld.Identity("bg"), shm=False) as c:
            tokens = list(range(40))
            assert (await c.spill(tokens, caches(40), droppable=False)).stored
            yield daemon, c, tokens
    finally:
        await daemon.stop()
        cleanup(root)


@pytest.mark.asyncio
async def test_background_reads_wait_while_a_client_reads_a_hit_until_it_says_it_has() -> None:
    """Found in review: the daemon counted a client busy for one second after a lookup only, so a restore that read
    longer (a long prefix from a cold disk) had the scrub reading beside it. A hit counts as being read until its
    client's touch (a restore done), or the read's deadline."""
    async with _a_stored_entry() as (daemon, c, tokens):
        assert isinstance(await c.lookup([*tokens, 1]), spilld.Hit)  # a hit, its files read by the client now
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert daemon._clients_active()  # still being read: the scrub waits
        assert await c.load([*tokens, 1]) is not None  # read, and said so (touch)
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert not daemon._clients_active()


@pytest.mark.asyncio
async def test_a_hit_the_client_will_not_read_holds_background_reads_no_longer_than_a_lookup() -> None:
    """Found in review: a lookup whose hit the client does not read (no longer than what its engine holds in memory:
    ``load(longer_than=...)``, mlx-lm's every request of a conversation it holds) counted as a hit being read until
    the read's deadline (``--io-timeout``, 30 s) with no touch to end it: against a real daemon, one such request
    every 4 s held the scrub paused for good (0 bytes checked in 16 s; misses at the same pace: 23 MB). The
    client now tells its lookup ``longer_than``."""
    async with _a_stored_entry() as (daemon, c, tokens):
        assert await c.load([*tokens, 1], longer_than=len(tokens)) is None  # the engine holds as much: not read
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert not daemon._clients_active()  # nobody reads it: the scrub goes on
        assert await c.load([*tokens, 1], longer_than=len(tokens) - 8) is not None  # longer: read, then touched
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert not daemon._clients_active()


def test_status_text_says_the_files_the_scrub_could_not_read(capsys: pytest.CaptureFixture[str]) -> None:
    """Found in review: the scrub counts stored files it could not read (EIO, a failing disk: what a scrub is for)
    in ``status``'s ``scrub.unreadable``, but ``spilld status`` printed only "0 bad files found"."""
    from spilld.cli.running import _print_status

    queue = {k: 0 for k in ("pending_items", "pending_bytes", "stored", "dropped", "cancelled", "failed")}
    store = {k: 0 for k in ("entries", "bytes", "disk_cap", "hits", "store_errors", "quarantined", "evicted")}
    st: dict[str, Any] = {
        "version": spilld.__version__, "pid": 1, "uptime_s": 1.0, "clients": 0, "socket": "s", "dir": "d", "cap": 1,
        "lookups": 0, "queue": queue | {"bytes_written": 0}, "store": store | {"misses": {}},
        "scrub": {"passes": 1, "files": 3, "bytes": 10, "planned_files": 3, "bad": 0, "unreadable": 2, "paused": False},
    }  # fmt: skip
    _print_status(st)
    out = capsys.readouterr().out
    assert "0 bad files found, 2 stored files could not be read" in out, out
    st["scrub"]["unreadable"] = 0
    _print_status(st)
    assert "could not be read" not in capsys.readouterr().out


@pytest.mark.asyncio
async def test_background_reads_wait_while_a_lookup_is_being_answered() -> None:
    """Found in review: the daemon counted a lookup as serving only from its answer on, so while the shared tier
    filled one (two real daemons on a redis-server: 33 MB of blocks fetched and written in 0.3 s) the scrub read
    beside the fill's writes, its client waiting for the answer."""
    import asyncio

    from spilld.client import AsyncClient
    from spilld.daemon import Daemon as InProcess
    from spilld.daemon.server import BUSY_AFTER_LOOKUP_S
    from tests.daemons import quiet_config

    root = new_root()
    daemon = InProcess(quiet_config(root, block_tokens=16))
    await daemon.start()
    filling, done = asyncio.Event(), asyncio.Event()

    class SlowTier:
        """A shared tier whose fill lasts until the test says, longer than a lookup counts as recent."""

        async def fill(self, *args: Any) -> bool:
            filling.set()
            await done.wait()
            return False

        def counters(self) -> dict[str, Any]:
            return {"state": "closed"}

    daemon.remote = SlowTier()  # type: ignore[assignment]
    try:
        async with AsyncClient(daemon.cfg.socket, identity=IDENT, shm=False) as c:
            looking = asyncio.ensure_future(c.lookup(list(range(40))))
            await asyncio.wait_for(filling.wait(), 30)
            await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
            assert daemon._busy() and daemon._clients_active()  # the fill is serving: the scrub waits
            done.set()
            assert isinstance(await looking, spilld.Miss)
            await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
            assert not daemon._clients_active()
    finally:
        done.set()  # a lookup left waiting would hold the stop
        daemon.remote = None
        await daemon.stop()
        cleanup(root)


@pytest.mark.asyncio
async def test_a_scrub_takes_a_file_gone_from_the_disk_out_of_the_store(tmp_path: Path) -> None:
    """Found in review: a block removed from under a running daemon (by hand, or a cleaner of old files) was counted
    unreadable and logged on every pass, never taken out: its entry stayed a hit that every client read missed. The
    scrub now takes it out as a restore that finds it gone does, a block with every entry naming it."""
    s, convs = await three_conversations(tmp_path)
    by_last = {int(e.tokens[-1]): e for e in s.entries}
    first, second, third = (by_last[c[-1]] for c in convs)
    own = s.block_path(first.blocks[2])  # the first conversation's own block (0 and 1 are shared)
    assert own is not None
    os.unlink(own)
    os.unlink(second.path)
    t = FakeTime()
    scrub = Scrub(s, 2**40, clock=t.clock, sleep=t.sleep)
    await scrub.scrub_pass()
    st = scrub.stats
    assert [e.path for e in s.entries] == [third.path] and not os.path.exists(first.path)  # its manifest went too
    assert (st.gone, st.unreadable, st.bad) == (2, 0, 0) and st.files == st.planned_files
    assert quarantined(tmp_path) == []  # nothing there to move aside
    got = s.restore(s.lookup(IDENT, "", [*convs[2], 1]), IDENT)  # type: ignore[arg-type]
    assert isinstance(got, spilld.Loaded) and got.tokens == convs[2]
    await scrub.scrub_pass()  # nothing left to find
    assert (st.gone, st.unreadable) == (2, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize(("interval", "first"), [(86_400.0, 600.0), (120.0, 120.0)])
async def test_the_first_scrub_pass_waits_ten_minutes_or_one_interval_if_shorter(
    tmp_path: Path, interval: float, first: float
) -> None:
    """As `spilld --help` and the README say of --scrub-every (found in review: they said 10 minutes alone)."""
    from spilld.scrub import FIRST_AFTER_S

    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)
        raise asyncio.CancelledError  # the first wait is all this test reads

    scrub = Scrub(Store(tmp_path, disk_cap=2**40), interval=interval, sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        await scrub.run()
    assert FIRST_AFTER_S == 600.0 and waits == [first]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["gone", "bad"])
async def test_a_hit_whose_read_fails_holds_background_reads_no_longer_than_a_lookup(how: str) -> None:
    """Found in review: a hit held background reads until its client's touch or the read's deadline
    (``--io-timeout``, 30 s), and a read that failed sent no touch: a file gone since the lookup (or one the client
    cannot use) and a bad file (``report_bad``) each held the scrub and the warm start for the whole deadline. The
    client says ``read_failed`` now, and ``report_bad`` ends the hold too."""
    async with _a_stored_entry() as (daemon, c, tokens):
        hit = await c.lookup([*tokens, 1])
        assert isinstance(hit, spilld.Hit)
        if how == "gone":
            os.unlink(hit.path)  # removed by hand: the index still holds it, the client's read fails
        else:
            flip(hit.path, os.path.getsize(hit.path) - 1)
        assert await c.load([*tokens, 1]) is None  # a miss to the engine
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert not daemon._clients_active(), daemon.restoring


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["entry", "block"])
async def test_a_file_a_clients_read_finds_gone_leaves_the_index(what: str) -> None:
    """Found in review: a file removed by hand under a running daemon stayed a hit, and every lookup of it a failed
    read (a prefill for the engine), until the scrub came by (a day apart by default). The client's ``read_failed``
    names the file; the daemon checks it is gone itself, and takes it out of its index."""
    async with _a_stored_entry() as (daemon, c, tokens):
        hit = await c.lookup([*tokens, 1])
        assert isinstance(hit, spilld.Hit)
        e = daemon.store.entry_at(hit.path)
        assert e is not None and e.blocks
        gone = daemon.store.block_path(e.blocks[0]) if what == "block" else hit.path
        os.unlink(gone)  # removed by hand: the index still holds it
        assert await c.load([*tokens, 1]) is None  # a miss to the engine
        assert not isinstance(await c.lookup([*tokens, 1]), spilld.Hit)  # and no hit any more
        assert not isinstance(await c.lookup(tokens[:20]), spilld.Hit)  # nor a shorter prefix of the same blocks


@pytest.mark.asyncio
async def test_a_client_gone_before_its_touch_holds_background_reads_no_longer_than_a_lookup() -> None:
    """Found in review: a client that looked up a hit and went away (killed mid-restore, or closed) held background
    reads for the read's deadline (``--io-timeout``, 30 s), no touch coming. Its connection's end ends its holds."""
    from spilld.client import AsyncClient

    async with _a_stored_entry() as (daemon, c, tokens):
        other = await AsyncClient.open(daemon.cfg.socket, identity=spilld.Identity("bg"), shm=False)
        assert isinstance(await other.lookup([*tokens, 1]), spilld.Hit)
        assert daemon.restoring  # its client reads it now
        await other.close()
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert not daemon._clients_active(), daemon.restoring
        assert isinstance(await c.lookup([*tokens, 1]), spilld.Hit)  # another's hit still holds them
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert daemon._clients_active()


@pytest.mark.asyncio
async def test_a_load_cancelled_mid_read_holds_background_reads_no_longer_than_a_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: an engine that cancelled its ``load`` while the client read the hit's files sent nothing, so
    the hit held the scrub and the warm start until the read's deadline (``--io-timeout``: against a real daemon,
    paused 29.3 s after the cancel returned). The cancelled load says ``read_failed`` once its thread has stopped
    reading; the file stays stored, and a hit."""
    import spilld.client
    from spilld import fileio, loader

    reads: list[float] = []  # when each of the client's reads ended

    class SlowOps(fileio.OwnFileOps):
        def preadv(self, fd: int, bufs: Any, offset: int) -> int:
            time.sleep(0.2)  # a cold disk
            try:
                return super().preadv(fd, bufs, offset)
            finally:
                reads.append(time.monotonic())

    slow = SlowOps()  # the client's reads only: the daemon in this process reads as before
    monkeypatch.setattr(spilld.client, "load", lambda *a, **kw: loader.load(*a, **(kw | {"ops": slow})))
    async with _a_stored_entry() as (daemon, c, tokens):
        load = asyncio.ensure_future(c.load([*tokens, 1]))
        while not reads:
            await asyncio.sleep(0.01)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        done = len(reads)
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert len(reads) == done  # its thread had stopped reading when the cancel returned
        assert not daemon._clients_active(), daemon.restoring
        hit = await c.lookup([*tokens, 1])  # not a bad file, nor gone: still stored
        assert isinstance(hit, spilld.Hit) and os.path.exists(hit.path)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_lookup_given_up_on_holds_background_reads_no_longer_than_a_lookup(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a load cancelled while the daemon answered its lookup (or one whose lookup timed out, the
    daemon answering after) never heard the hit, read nothing and said nothing: the hit held the scrub and the warm
    start until the read's deadline (``--io-timeout``: against a real daemon, its scrub paused 30.1 s after
    the cancel). The client hears the answer of a lookup it gave up on, and says ``read_failed`` for a hit."""
    import spilld.client
    from spilld.errors import Timeout

    monkeypatch.setattr(spilld.client, "LOOKUP_TIMEOUT_S", 0.3)
    async with _a_stored_entry() as (daemon, c, tokens):
        asked, answer = asyncio.Event(), asyncio.Event()
        lookup = daemon.methods["lookup"]

        async def slow(*args: Any) -> Any:  # a lookup answered once the test says (a fill from a shared tier)
            asked.set()
            await answer.wait()
            return await lookup(*args)

        monkeypatch.setitem(daemon.methods, "lookup", slow)
        load = asyncio.ensure_future(c.load([*tokens, 1]))
        await asyncio.wait_for(asked.wait(), 10)
        if how == "cancelled":
            load.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancelled" else Timeout):
            await asyncio.wait_for(load, 5)
        answer.set()  # a hit: held as being read by this client
        await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
        assert not daemon._clients_active(), daemon.restoring
        assert isinstance(await c.lookup([*tokens, 1]), spilld.Hit)  # still stored (its file is not gone)


@pytest.mark.asyncio
async def test_a_load_cancelled_while_its_touch_waits_behind_a_send_holds_background_reads_no_longer_than_a_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: a load cancelled after its read, while its ``touch`` waited for another send (a spill's, the
    socket full) to be written, never sent it: the hit held the scrub and the warm start until the read's deadline
    (``--io-timeout``: against a real daemon, its scrub paused 30.0 s after the cancel). The touch is written then,
    without waiting: the cancel stays prompt, and the daemon counts the restore."""
    async with _a_stored_entry() as (daemon, c, tokens):
        touching = asyncio.Event()
        call = c.call

        async def behind_a_send(method: str, params: Any = None, **kw: Any) -> Any:
            if method == "touch":  # another send holds the connection's send lock (waiting for room)
                await c._send_lock.acquire()
                touching.set()
            return await call(method, params, **kw)

        monkeypatch.setattr(c, "call", behind_a_send)
        load = asyncio.ensure_future(c.load([*tokens, 1]))
        try:
            await asyncio.wait_for(touching.wait(), 10)
            await asyncio.sleep(0.05)  # the touch waits for the lock
            t0 = time.monotonic()
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            assert time.monotonic() - t0 < 0.2  # the cancel waits on nothing
            await asyncio.sleep(BUSY_AFTER_LOOKUP_S + 0.3)
            assert not daemon._clients_active(), daemon.restoring
            assert daemon.store.counters.hits == 1
        finally:
            c._send_lock.release()  # the other send goes on


@pytest.mark.asyncio
async def test_read_failed_without_its_file_checks_and_names_the_hits_entry(caplog: pytest.LogCaptureFixture) -> None:
    """``read_failed``'s ``file`` is optional (format.md §10: the hit's entry by default). Found in review: the
    daemon checked the entry then, but its warning named the file as "None"."""
    async with _a_stored_entry() as (_, c, tokens):
        hit = await c.lookup([*tokens, 1])
        assert isinstance(hit, spilld.Hit)
        os.unlink(hit.path)
        with caplog.at_level(logging.WARNING, logger="spilld"):
            assert await c.call("read_failed", {"path": hit.path}) == {"released": True, "gone": True}
        said = [r.getMessage() for r in caplog.records if "gone from the disk" in r.getMessage()]
        assert said and all(m.endswith(hit.path) for m in said), said
