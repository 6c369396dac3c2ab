"""I/O errors through the daemon: ENOSPC and EIO at the N-th write, fsync, rename and fallocate of a save.

A real ``Daemon`` serves a real Unix socket in the test's event loop and a real ``AsyncClient`` spills real
mlx-lm caches to it. The daemon's store writes through ``FaultyOps``, a file layer that counts the calls of one
save (a clean spill is recorded first, so N runs over every such call) and then fails the N-th one, once
(transient) or from then on (persistent, until lifted). Both write paths are hit: the buffered path (small
items) and the O_DIRECT path (items of 8 MiB or more, written by the direct writer's thread).

For every case: the faulted item settles with its outcome (failed with ``disk_full`` or ``io_error``, or stored
when eviction made room), the daemon serves the next spill and it loads exactly, no temp or unindexed file is
left in the store folder, lookups never return the failed entry, the status counters move, evictions follow
least-recent use, no fd is fsynced (or used at all) after a call on it failed, and no fd or writer thread leaks.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop
from mlx_lm.models import cache as C

import spilld
from spilld import directio, errors, fileio, shm
from spilld.client import AsyncClient
from spilld.config import Config
from spilld.daemon import Daemon
from spilld.entries import MissReason
from spilld.lockfile import LOCK_NAME
from spilld.queue import Outcome, Settled
from tests.caches import chunked, fill, live, same
from tests.conftest import LONG, open_fds
from tests.daemons import cleanup, new_root

IDENT = spilld.Identity("io-errors", "cfg", "tok", "")
OPS = ("write", "fsync", "rename", "fallocate")
ERRNOS = {errno.ENOSPC: "disk_full", errno.EIO: "io_error"}
LOOPS = ("uvloop", "asyncio") if LONG else ("uvloop",)  # uvloop: what `spilld serve` runs on
INGEST = ("shm", "inline") if LONG else ("shm",)

pytestmark = pytest.mark.skipif(not directio.O_DIRECT or not os.path.isdir("/proc/self/fd"), reason="Linux only")


# --- the faulty file layer ---------------------------------------------------------------------


@dataclass(eq=False)
class FdLog:
    """One open of a file or folder by the save path, and every call made on it."""

    path: str
    flags: int
    calls: list[str] = field(default_factory=list)
    failed: int = -1  # index in ``calls`` of the first call that failed on this fd

    @property
    def closed(self) -> bool:
        return bool(self.calls) and self.calls[-1] == "close"


class FaultyOps(fileio.FileOps):
    """Counts write/fsync/rename/fallocate calls and fails the N-th of one of them with an errno.

    Thread-safe: the O_DIRECT path writes from its own thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.open: dict[int, FdLog] = {}
        self.log: list[FdLog] = []
        self.op, self.nth, self.errno, self.persistent = "", 0, 0, False
        self.fired = 0

    def arm(self, op: str = "", nth: int = 0, err: int = 0, persistent: bool = False) -> None:
        """Count from zero; fail the ``nth`` call of ``op`` (and, if persistent, every later one)."""
        with self._lock:
            self.calls.clear()
            self.log.clear()
            self.op, self.nth, self.errno, self.persistent, self.fired = op, nth, err, persistent, 0

    def block_names_failed(self) -> bool:
        """The fault hit the folder fsync that makes a put's block names durable (a folder's fsync before any
        manifest file): that put fails, with no eviction and no retry (a second fsync may succeed without them)."""
        for i, rec in enumerate(self.log):
            if rec.failed >= 0 and rec.path.endswith("/"):
                return not any(not r.path.endswith("/") and "spilld-block" not in r.path for r in self.log[:i])
        return False

    def lift(self) -> None:
        with self._lock:
            self.op = ""

    def _call(self, op: str, fd: int | None = None) -> None:
        with self._lock:
            self.calls[op] += 1
            n = self.calls[op]
            rec = self.open.get(fd) if fd is not None else None
            if rec is not None:
                rec.calls.append(op)
            if op != self.op or not (n == self.nth or (self.persistent and n > self.nth)):
                return
            self.fired += 1
            if rec is not None and rec.failed < 0:
                rec.failed = len(rec.calls) - 1
        raise OSError(self.errno, os.strerror(self.errno))

    def _opened(self, fd: int, path: str, flags: int) -> int:
        with self._lock:
            rec = FdLog(path, flags)
            self.open[fd] = rec
            self.log.append(rec)
        return fd

    def open_new(self, path: str, flags: int = 0) -> int:
        return self._opened(super().open_new(path, flags), path, flags)

    def open_dir(self, path: str) -> int:
        return self._opened(super().open_dir(path), path + "/", 0)

    def close(self, fd: int) -> None:
        with self._lock:
            rec = self.open.pop(fd, None)
            if rec is not None:
                rec.calls.append("close")
        super().close(fd)

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        self._call("write", fd)
        return super().pwritev(fd, bufs, offset)

    def fsync(self, fd: int, durability: fileio.Durability) -> None:
        self._call("fsync", fd)
        super().fsync(fd, durability)

    def fallocate(self, fd: int, size: int) -> None:
        self._call("fallocate", fd)
        super().fallocate(fd, size)

    def rename(self, src: str, dst: str) -> None:
        self._call("rename")
        super().rename(src, dst)


# --- what is spilled ----------------------------------------------------------------------------


def buffered_item(seed: int) -> list[Any]:
    """A small item: the buffered write path."""
    if LONG:  # more cache classes, more tensors, more writes to fail
        q = fill(C.QuantizedKVCache(group_size=32, bits=4), 48, dim=64, seed=seed + 3)
        return [
            fill(C.KVCache(), 48, seed=seed),
            fill(C.RotatingKVCache(32, keep=4), 48, seed=seed + 1),
            chunked(48),
            q,
        ]
    return [fill(C.KVCache(), 48, heads=2, dim=16, seed=seed), fill(C.RotatingKVCache(32, keep=4), 48, seed=seed + 1)]


def direct_item(seed: int) -> list[Any]:
    """An item over 8 MiB: the O_DIRECT path, each big tensor in a full chunk plus a padded tail."""
    big = fill(C.KVCache(), 5000, heads=4, dim=128, seed=seed)  # 2 x 10.24 MB
    return [big, fill(C.KVCache(), 37, heads=3, dim=24, seed=seed + 1)] if LONG else [big]


ITEMS: dict[str, Callable[[int], list[Any]]] = {"buffered": buffered_item, "direct": direct_item}


def ntok(caches: list[Any]) -> int:
    """Tokens to spill with these caches: as many as each of them has seen (a model's layers all have)."""
    offsets = {c.offset for c in caches}
    assert len(offsets) == 1, offsets
    return offsets.pop()


def data_bytes(caches: list[Any]) -> int:
    header, _ = spilld.saver.plan([], caches, identity=IDENT)
    return header.data_bytes


# --- the daemon in this event loop --------------------------------------------------------------


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ops: FaultyOps
    path: str  # buffered | direct
    item: list[Any]
    good: list[Any]
    old: list[Any]
    need: int  # the item's data bytes: what the store evicts to make room for on ENOSPC at its first file
    calls: Counter[str] = field(default_factory=Counter)
    cases: int = 0


@asynccontextmanager
async def serving(path: str, ingest: str) -> AsyncIterator[Env]:
    root = new_root()
    cfg = Config(
        cap=512 * 1024**2,
        disk_cap=2**40,
        dir=os.path.join(root, "store"),
        socket=os.path.join(root, "run", "spilld.sock"),
        drain_deadline=30.0,
        # the buffered path saves in blocks (a fault at every call of every block and of the manifest); the
        # direct path writes whole files, as only files of DIRECT_MIN_BYTES or more take it
        block_tokens=0 if path == "direct" else 16,
    )
    daemon = Daemon(cfg)
    ops = FaultyOps()
    daemon.store.ops = ops  # every save of the daemon goes through the faulty layer
    await daemon.start()
    client = await AsyncClient.open(cfg.socket, identity=IDENT, name="io-errors", shm=ingest == "shm")
    try:
        item = ITEMS[path](1)
        yield Env(daemon, client, ops, path, item, ITEMS[path](2), buffered_item(3), data_bytes(item))
    finally:
        await client.close(timeout=30)
        await daemon.stop()
        cleanup(root)


def fd_targets() -> Counter[str]:
    """What this process's fds point at, shared-memory segments excepted (the daemon maps a client's lazily)."""
    out: Counter[str] = Counter()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own fd, already closed
        if not target.startswith("/dev/shm/"):
            out[target] += 1
    return out


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "spilld-direct-writer"]


def check_folder(d: Daemon) -> None:
    """No temp file, nothing quarantined, and exactly the indexed entries on disk."""
    temps: list[str] = []
    files: set[str] = set()
    for dirpath, _, names in os.walk(d.cfg.dir):
        for n in names:
            if fileio.is_temp_name(n):
                temps.append(os.path.join(dirpath, n))
            elif n != LOCK_NAME:  # the folder's lock file (held by the daemon)
                files.add(os.path.join(dirpath, n))
    assert temps == [], f"temp files left: {temps}"
    indexed = {e.path for e in d.store.entries} | {b.path for b in d.store.blocks}
    assert files == indexed, "files on disk differ from the index"


def check_fds(ops: FaultyOps) -> None:
    """Every fd the save path opened is closed, and nothing but close follows a failed call on an fd."""
    for rec in ops.log:
        assert rec.closed, f"fd of {rec.path} never closed: {rec.calls}"
        if rec.failed >= 0:
            # the failed call, then only the close: a failed fd is never fsynced (or written) again
            assert rec.calls[rec.failed + 1 :] == ["close"], f"{rec.path}: {rec.calls} (call {rec.failed} failed)"


async def count_calls(env: Env) -> Counter[str]:
    """Record one clean spill of the item: how many of each call a save makes (into folders that exist)."""
    assert (
        await env.client.spill(list(range(900_000, 900_000 + ntok(env.good))), env.good)
    ).stored  # makes the folders
    env.ops.arm()
    blocks_before = env.daemon.store.counters.blocks_written
    tokens = list(range(1, 1 + ntok(env.item)))
    assert (await env.client.spill(tokens, env.item)).stored
    calls = Counter(env.ops.calls)
    files = 1 + env.daemon.store.counters.blocks_written - blocks_before  # its blocks (v2), then its manifest
    folder_syncs = 1 + (files > 1)  # one for all the blocks, one for the manifest
    assert calls["rename"] == files and calls["fallocate"] == files, calls
    assert calls["fsync"] == files + folder_syncs, calls
    direct = [rec for rec in env.ops.log if rec.flags & directio.O_DIRECT]
    assert bool(direct) == (env.path == "direct"), "the item did not take the intended write path"
    await evict_all(env)
    return calls


async def evict_all(env: Env) -> None:
    await env.client.call("evict", {})
    check_folder(env.daemon)
    assert env.daemon.store.entries == []


async def loads_exactly(client: AsyncClient, tokens: list[int], caches: list[Any]) -> bool:
    got = await client.load([*tokens, 0])
    if got is None:
        return False
    assert got.tokens == tokens
    assert all(same(live(a), live(b)) for a, b in zip(got.caches, caches, strict=True)), "a wrong tensor came back"
    return True


# --- the cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    op: str
    nth: int
    err: int
    persistent: bool
    old: bool  # older entries present (something to evict)

    @property
    def recovers(self) -> bool:
        """Only a transient ENOSPC with something to evict ends stored: evict, retry once."""
        return self.err == errno.ENOSPC and self.old and not self.persistent

    def __str__(self) -> str:
        how = "persistent" if self.persistent else "once"
        return f"{errno.errorcode[self.err]} at {self.op} #{self.nth} ({how}, {'old entries' if self.old else 'empty'})"


def cases(op: str, count: int) -> list[Case]:
    out = []
    for nth in range(1, count + 1):
        for err in ERRNOS:
            for persistent in (False, True):
                for old in (True, False) if err == errno.ENOSPC else (True,):
                    out.append(Case(op, nth, err, persistent, old))
    return out


async def run_case(env: Env, case: Case, base: int) -> None:
    d, client, ops = env.daemon, env.client, env.ops
    # older entries A then B, then A used: B is the least recently used
    olds: list[tuple[list[int], int]] = []
    if case.old:
        for k in range(2):
            tokens = list(range(base + 1000 * k, base + 1000 * k + ntok(env.old)))
            before = (await client.status())["store"]["bytes"]
            assert (await client.spill(tokens, env.old)).stored
            # what its eviction frees: its manifest and its blocks (a small file is packed, so no page of padding)
            olds.append((tokens, (await client.status())["store"]["bytes"] - before))
        assert await loads_exactly(client, olds[0][0], env.old)
    lru = list(reversed(olds))
    st0 = await client.status()
    fds0 = fd_targets()

    ops.arm(case.op, case.nth, case.err, case.persistent)
    tokens = list(range(base + 5000, base + 5000 + ntok(env.item)))
    settled: Settled = await client.spill(tokens, env.item)
    ops.lift()
    st1 = await client.status()

    assert ops.fired >= 1, "the fault never fired"
    check_fds(ops)
    files = [rec for rec in ops.log if not rec.path.endswith("/")]  # none when a new folder's fsync failed first
    assert not files or any(rec.flags & directio.O_DIRECT for rec in files) == (env.path == "direct")
    for rec in ops.log:  # a fault on a file's fd hit the intended write path
        if rec.failed >= 0 and not rec.path.endswith("/"):
            assert bool(rec.flags & directio.O_DIRECT) == (env.path == "direct"), rec
    code = ERRNOS[case.err]
    names_lost = ops.block_names_failed()
    recovers = case.recovers and not names_lost
    if recovers:
        assert settled.outcome is Outcome.STORED, settled.error
        assert await loads_exactly(client, tokens, env.item)
    else:
        assert settled.outcome is Outcome.FAILED
        assert isinstance(settled.error, errors.StorageError) and settled.error.code == code, settled.error
        assert isinstance(await client.lookup([*tokens, 0]), spilld.Miss)  # the failed entry is never served
    check_folder(d)

    # evictions: least recently used first, only on ENOSPC, just enough for the item (at least one)
    gone = [t for t, _ in lru if isinstance(await client.lookup([*t, 0]), spilld.Miss)]
    want = 0
    if case.err == errno.ENOSPC and olds and not names_lost:
        need, freed = env.need, 0
        for _, size in lru:
            want += 1
            freed += size
            if freed >= need:
                break
    assert gone == [t for t, _ in lru[:want]], f"evicted {len(gone)} of {len(lru)}, expected the {want} oldest"
    for t in gone:
        assert (await client.lookup([*t, 0])) == spilld.Miss(MissReason.EVICTED)
    for t, _ in lru[want:]:
        assert await loads_exactly(client, t, env.old)

    # counters
    q0, q1, s0, s1 = st0["queue"], st1["queue"], st0["store"], st1["store"]
    failed = 0 if recovers else 1
    assert q1["failed"] - q0["failed"] == failed
    assert q1["stored"] - q0["stored"] == 1 - failed
    assert s1["stored"] - s0["stored"] == 1 - failed
    assert s1["store_errors"] - s0["store_errors"] == failed
    assert s1["errors"].get(code, 0) - s0["errors"].get(code, 0) == failed
    assert s1["evicted"] - s0["evicted"] == want
    assert s1["quarantined"] == 0

    # the daemon serves the next spill, on the same write path, and it loads exactly
    ops.arm()
    good = list(range(base + 7000, base + 7000 + ntok(env.good)))
    assert (await client.spill(good, env.good)).stored
    assert any(rec.flags & directio.O_DIRECT for rec in ops.log) == (env.path == "direct")
    assert await loads_exactly(client, good, env.good)
    check_folder(d)
    assert d.queue.pending_items == 0

    assert writer_threads() == []
    assert fd_targets() == fds0, "an fd leaked"
    await evict_all(env)


async def sweep(path: str, op: str, ingest: str) -> int:
    async with serving(path, ingest) as env:
        env.calls = await count_calls(env)
        for i, case in enumerate(cases(op, env.calls[op])):
            try:
                await run_case(env, case, base=(i + 1) * 10_000)
            except AssertionError as exc:
                exc.add_note(f"case: {path} path, {case}")
                raise
            env.cases += 1
        return env.cases


async def warm_up(path: str, ingest: str) -> int:
    async with serving(path, ingest) as env:
        assert (await env.client.spill(list(range(ntok(env.item))), env.item)).stored
        return 0


def run_on(loop: str, coro: Coroutine[Any, Any, int]) -> int:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


@pytest.mark.parametrize("ingest", INGEST)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("path", ["buffered", "direct"])
def test_fault_at_every_call_of_a_save(path: str, op: str, loop: str, ingest: str, monkeypatch: Any) -> None:
    # Client and daemon share this process, so they share Python's shared-memory tracker: the daemon's
    # untracking of a segment it maps would drop the client's own registration (a separate daemon keeps it).
    monkeypatch.setattr(shm, "_untrack", lambda seg: None)
    run_on(loop, warm_up(path, ingest))  # process-wide pools and trackers start here, not in the sweep
    fds = open_fds()
    n = run_on(loop, sweep(path, op, ingest))
    assert open_fds() == fds, "an fd leaked across the whole sweep (client, daemon and loop closed)"
    print(f"io-errors {path}/{op}/{loop}/{ingest}: {n} cases")
    assert n >= 6


@pytest.mark.parametrize("durability", [fileio.Durability.FSYNC, fileio.Durability.NONE], ids=["fsync", "none"])
def test_an_error_at_close_is_a_typed_error_and_publishes_nothing(tmp_path: Any, durability: Any) -> None:
    """Found in review: NFS and FUSE report a deferred write error at close(), and ``publish_all`` (a remote
    fill's writes) let it out raw, an OSError the callers that catch ``SpillError`` did not take: the daemon answered
    that lookup with an internal error."""

    class CloseFails(fileio.FileOps):
        def __init__(self) -> None:
            self.armed = True

        def close(self, fd: int) -> None:
            super().close(fd)
            if self.armed:
                self.armed = False
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    files = [(str(tmp_path / f"f{i}"), bytes(4096)) for i in range(3)]
    with pytest.raises(errors.DiskFull):
        fileio.publish_all(CloseFails(), files, durability)
    assert os.listdir(tmp_path) == []  # all or nothing
    ops = CloseFails()
    if durability is fileio.Durability.FSYNC:
        with pytest.raises(errors.DiskFull):
            fileio.sync_dir(ops, str(tmp_path), durability)


class RefusedUnlinks(fileio.FileOps):
    """The first unlink of each path fails with EIO (a failing disk, a folder remounted read-only a while)."""

    def __init__(self) -> None:
        self.refused: set[str] = set()

    def unlink(self, path: str) -> None:
        if path not in self.refused:
            self.refused.add(path)
            raise OSError(errno.EIO, "Input/output error", path)
        super().unlink(path)


@pytest.mark.asyncio
async def test_a_refused_unlink_is_tried_again_never_dropped(tmp_path: Any) -> None:
    """Found in review: an unlink that failed (EIO, EROFS) was dropped, the file out of the index but on disk: 60
    puts over a cap of 10 entries left 60 files and 4 MB against a 0.7 MB cap, and a restart's scan indexed all 60
    (evicted and superseded entries came back). A refused unlink is tried again at the next removal."""
    from spilld.store import Store

    ops = RefusedUnlinks()
    s = Store(tmp_path, disk_cap=2**40, block_tokens=0, durability="none", ops=ops)
    for i in range(6):
        await s.put([i * 1000 + t for t in range(32)], [fill(C.KVCache(), 32, seed=i)], spilld.Identity("m"))
    s.disk_cap = s.total_bytes // 3  # room for two
    s.evict_to_cap()
    await s.delete_doomed_async()  # each refused once
    assert s.count == 2 and len(ops.refused) == 4
    await s.delete_doomed_async()  # and tried again
    on_disk = [os.path.join(d, n) for d, _, names in os.walk(tmp_path) for n in names if n.endswith(".spilld")]
    assert sorted(on_disk) == sorted(e.path for e in s.entries)
    again = Store(tmp_path, disk_cap=2**40, block_tokens=0)
    again.scan()
    assert again.count == 2  # none of them comes back


class FailingClose(fileio.FileOps):
    """close() reports EIO after closing (a deferred write error, as NFS reports one)."""

    def close(self, fd: int) -> None:
        super().close(fd)
        raise OSError(errno.EIO, "Input/output error")


def test_a_probe_whose_close_fails_is_a_storage_error_and_leaves_nothing(tmp_path: Any) -> None:
    """Found in review: the start-up probe's close raised a raw EIO past its cleanup, so the probe file stayed
    (one more at each start of a restart loop) and the daemon's start failed untyped."""
    for _ in range(3):
        with pytest.raises(errors.StorageError):
            fileio.probe_writable(FailingClose(), str(tmp_path))
    assert os.listdir(tmp_path) == []


class HungThenRefusedUnlink(fileio.FileOps):
    """The first unlink hangs past the I/O deadline, then fails with EIO (how a hung disk's call usually ends)."""

    def __init__(self) -> None:
        self.calls = 0

    def unlink(self, path: str) -> None:
        self.calls += 1
        if self.calls == 1:
            threading.Event().wait(0.5)
            raise OSError(errno.EIO, "Input/output error", path)
        super().unlink(path)


@pytest.mark.asyncio
async def test_unlinks_past_the_io_deadline_are_tried_again(tmp_path: Any) -> None:
    """Found in review: unlinks given up on at the I/O deadline were dropped, as a refused unlink had been: a file
    the late call could not remove stayed, out of the index, and came back at the next scan."""
    from spilld.store import Store

    s = Store(tmp_path, disk_cap=2**40, block_tokens=0, durability="none", ops=HungThenRefusedUnlink(), io_timeout=0.1)
    first = await s.put(list(range(32)), [fill(C.KVCache(), 32)], spilld.Identity("m"))
    await s.put(list(range(100, 132)), [fill(C.KVCache(), 32, seed=1)], spilld.Identity("m"))
    s.disk_cap = s.total_bytes - 1  # room for one: the first goes
    s.evict_to_cap()
    await s.delete_doomed_async()  # past the deadline (its call then fails)
    await asyncio.sleep(0.6)
    await s.delete_doomed_async()
    assert not os.path.exists(first.path) and s.count == 1
