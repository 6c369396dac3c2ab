"""The O_DIRECT path: same bytes as the buffered path, errors surface, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.saver
from spilld import directio, errors, fileio
from spilld import format as fmt
from tests.caches import fill, live, same
from tests.conftest import open_fds
from tests.test_saver import FailingOps

pytestmark = pytest.mark.skipif(not directio.O_DIRECT, reason="no O_DIRECT on this platform")


def caches() -> list[Any]:
    # odd sizes: tensors end off block boundaries, and one spans several chunks
    return [fill(C.KVCache(), 37, heads=3, dim=24, seed=1), fill(C.KVCache(), 3000, heads=8, dim=128, seed=2)]


def test_direct_and_buffered_write_the_same_file(tmp_path: Any) -> None:
    cs = caches()
    toks = list(range(3000))  # as many tokens as the longest cache holds
    a = spilld.save(tmp_path / "direct", toks, cs, direct=True)
    b = spilld.save(tmp_path / "buffered", toks, cs, direct=False)
    assert [s.hash for s in a.header.slots()] == [s.hash for s in b.header.slots()]
    da, db = (tmp_path / "direct").read_bytes(), (tmp_path / "buffered").read_bytes()
    assert len(da) == len(db) == a.file_bytes
    assert da[64:] == db[64:]  # all but the prefix's creation-time-dependent header bytes
    got = spilld.load(tmp_path / "direct").caches
    assert all(same(live(x), live(y)) for x, y in zip(got, cs, strict=True))


def direct_writers(monkeypatch: Any) -> list[int]:
    """One item for each O_DIRECT writer made from now on."""
    made: list[int] = []
    real = directio.DirectWriter.__init__

    def spy(self: Any, *a: Any) -> None:
        made.append(1)
        real(self, *a)

    monkeypatch.setattr(directio.DirectWriter, "__init__", spy)
    return made


def test_large_saves_use_direct_io_by_default(tmp_path: Any, monkeypatch: Any) -> None:
    made = direct_writers(monkeypatch)
    spilld.save(tmp_path / "small", [], [fill(C.KVCache(), 5)])
    assert made == []
    spilld.save(tmp_path / "big", [], [fill(C.KVCache(), 4096, heads=8, dim=128)])
    assert made == [1]


def test_a_packed_file_is_written_buffered_even_when_direct_is_asked(tmp_path: Any, monkeypatch: Any) -> None:
    made = direct_writers(monkeypatch)
    cs = [fill(C.KVCache(), 37, heads=3, dim=24, seed=1)]  # 64-byte offsets: not O_DIRECT's 4 KiB blocks
    a = spilld.save(tmp_path / "asked", list(range(37)), cs, direct=True)
    assert a.header.align == fmt.COMPACT_ALIGN and made == []
    got = spilld.load(tmp_path / "asked").caches
    assert all(same(live(x), live(y)) for x, y in zip(got, cs, strict=True))


def test_writer_thread_errors_surface_and_leave_nothing(tmp_path: Any) -> None:
    threads, fds = set(threading.enumerate()), open_fds()  # (a thread of an earlier test may end meanwhile)
    with pytest.raises(errors.DiskFull):
        spilld.save(tmp_path / "f", [], caches(), direct=True, ops=FailingOps("write"))
    assert os.listdir(tmp_path) == []
    assert set(threading.enumerate()) - threads == set() and open_fds() <= fds


def test_closing_mid_save_stops_the_writer(tmp_path: Any) -> None:
    threads, fds = set(threading.enumerate()), open_fds()  # (a thread of an earlier test may end meanwhile)
    gen = spilld.saver.save_steps(tmp_path / "f", [], caches(), direct=True)
    step = next(gen)
    step.materialize()
    step.write()
    next(gen)
    gen.close()
    assert os.listdir(tmp_path) == []
    assert set(threading.enumerate()) - threads == set() and open_fds() <= fds


def test_falls_back_to_buffered_where_o_direct_is_refused(tmp_path: Any) -> None:
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no tmpfs at /dev/shm")
    folder = os.path.join(shm, f"spilld-test-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    try:
        cs = caches()
        spilld.save(os.path.join(folder, "f"), [], cs, direct=True)
        got = spilld.load(os.path.join(folder, "f")).caches
        assert all(same(live(x), live(y)) for x, y in zip(got, cs, strict=True))
    finally:
        for n in os.listdir(folder):
            os.unlink(os.path.join(folder, n))
        os.rmdir(folder)


def test_a_buffer_queued_before_a_failed_take_goes_back_to_the_pool_once(tmp_path: Any, monkeypatch: Any) -> None:
    """Found in review: a ``POOL.take`` that raised (mmap ENOMEM; Ctrl-C while the pool is exhausted) after a full
    chunk was queued gave the queued buffer back, and the writer thread gave it back again: two saves could then
    fill one buffer at once."""
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    writer = directio.DirectWriter(fd, path, fileio.DEFAULT_OPS)
    real_take, takes = directio.POOL.take, [0]

    def take() -> Any:
        takes[0] += 1
        if takes[0] == 2:  # the take after the first full chunk was queued
            raise MemoryError("no memory for another buffer")
        return real_take()

    monkeypatch.setattr(directio.POOL, "take", take)
    try:
        with pytest.raises(MemoryError):
            writer.write([memoryview(bytes(directio.CHUNK + 4096))], 0)
    finally:
        writer.close()
        os.close(fd)
    free = []
    while not directio.POOL._free.empty():
        free.append(directio.POOL._free.get_nowait())
    for buf in dict.fromkeys(free):  # the pool as it was, each buffer once
        directio.POOL._free.put(buf)
    assert len(free) == len({id(b) for b in free}), "a buffer is in the pool twice"


def test_a_buffer_whose_queueing_was_interrupted_goes_back_to_the_pool(tmp_path: Any, monkeypatch: Any) -> None:
    """Found in review of the fix above: the buffer was marked queued before the (blocking) put, so a put
    interrupted while the disk was behind (Ctrl-C) left it out of the pool for good: after a few, every O_DIRECT
    save in the process waited for a buffer for ever."""
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    writer = directio.DirectWriter(fd, path, fileio.DEFAULT_OPS)
    before = directio.POOL._free.qsize() + (2 * directio.DEPTH - directio.POOL._made)  # buffers free or not made

    def interrupted(item: Any, *a: Any, **kw: Any) -> None:
        raise KeyboardInterrupt  # while blocked on the full queue: nothing was queued

    monkeypatch.setattr(writer._jobs, "put", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.write([memoryview(bytes(directio.CHUNK))], 0)
    finally:
        monkeypatch.undo()
        writer.close()
        os.close(fd)
    assert directio.POOL._free.qsize() + (2 * directio.DEPTH - directio.POOL._made) == before


HANG_S = 1.5


class HungDirectWrite(fileio.FileOps):
    """The O_DIRECT writer thread's first write does not return for ``HANG_S`` (a disk that stopped answering)."""

    def __init__(self) -> None:
        self.hung = threading.Event()

    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        if threading.current_thread().name == "spilld-direct-writer" and not self.hung.is_set():
            self.hung.set()
            time.sleep(HANG_S)
        return super().pwritev(fd, bufs, offset)


@pytest.mark.asyncio
async def test_a_save_cancelled_while_its_writer_thread_hangs_never_stalls_the_loop(tmp_path: Any) -> None:
    """Found in review: a save cancelled while it waited on the loop (for an engine's lock: a queue's close at its
    deadline) closed its generator on the loop, and the O_DIRECT writer's close joined the thread the hung disk
    held: the whole loop stood still until the disk answered."""
    cache = fill(C.KVCache(), 4096, heads=8, dim=128)  # a full chunk a tensor: the first write hangs the writer
    ops, engine_done = HungDirectWrite(), asyncio.Event()
    gaps: list[float] = []
    holds = 0

    async def engine_lease(fn: Any) -> Any:  # the first hold is granted; then the engine keeps its lock
        nonlocal holds
        holds += 1
        if holds > 1:
            await engine_done.wait()
        return fn()

    async def heartbeat() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beat = asyncio.ensure_future(heartbeat())
    save = asyncio.ensure_future(
        spilld.saver.save_async(
            str(tmp_path / "x.spilld"), list(range(4096)), [cache], ops=ops, direct=True, run_step=engine_lease
        )
    )
    try:
        deadline = time.monotonic() + 10
        while not (ops.hung.is_set() and holds > 1) and not save.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if not ops.hung.is_set():
            pytest.skip("no O_DIRECT write on this file system")
        gaps.clear()
        save.cancel()  # it waits for the engine's lock; its writer thread waits for the disk
        with pytest.raises(asyncio.CancelledError):
            await save
        await asyncio.sleep(0.05)  # the heartbeat's next beat records a stall that has just ended
        assert max(gaps, default=0.0) < HANG_S / 3, f"the loop stood still for {max(gaps):.2f} s"
        assert os.listdir(tmp_path) == []  # its temp file went once the disk answered
    finally:
        engine_done.set()
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
