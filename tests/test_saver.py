"""The generator saver: steps, cleanup on every exit path, durability, async driving."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
import spilld.saver
from spilld import errors, fileio
from spilld.codecs.base import Source
from spilld.saver import PublishStep, TensorStep
from tests.caches import fill, live, same
from tests.conftest import open_fds


def caches(n_layers: int = 3) -> list[Any]:
    return [fill(C.KVCache(), 17, seed=i) for i in range(n_layers)]


def test_n_tensors_give_n_plus_one_steps(tmp_path: Any) -> None:
    gen = spilld.saver.save_steps(tmp_path / "f", list(range(17)), caches(3))
    steps = []
    for step in gen:
        steps.append(step)
        step.materialize()
        step.write()
    assert len(steps) == 7
    assert all(isinstance(s, TensorStep) for s in steps[:-1]) and isinstance(steps[-1], PublishStep)
    assert os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("stop_after", range(0, 7))
@pytest.mark.parametrize("how", ["close", "throw", "skip"])
def test_leaving_at_any_step_leaves_nothing(tmp_path: Any, stop_after: int, how: str) -> None:
    before = open_fds()
    gen = spilld.saver.save_steps(tmp_path / "f", [], caches(3))
    steps = []
    for i, step in enumerate(gen):
        steps.append(step)
        if i == stop_after:
            if how == "close":
                gen.close()
            elif how == "throw":
                with pytest.raises(KeyboardInterrupt):
                    gen.throw(KeyboardInterrupt())
            else:  # a driver that forgets to run the step
                with pytest.raises(errors.SaveAborted):
                    next(gen)
            break
        step.materialize()
        step.write()
    assert os.listdir(tmp_path) == []
    assert open_fds() == before
    # no array is pinned by a finished step
    assert all(s.bytes.released for s in steps if isinstance(s, TensorStep))


def test_steps_must_run_in_order(tmp_path: Any) -> None:
    gen = spilld.saver.save_steps(tmp_path / "f", [], caches(1))
    step = next(gen)
    with pytest.raises(errors.SaveAborted):
        step.write()  # not materialized yet
    gen.close()
    assert os.listdir(tmp_path) == []


class RecordingOps(fileio.FileOps):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def fsync(self, fd: int, durability: fileio.Durability) -> None:
        self.calls.append(f"fsync:{durability.value}")
        super().fsync(fd, durability)

    def open_dir(self, path: str) -> int:
        self.calls.append("open_dir")
        return super().open_dir(path)

    def rename(self, src: str, dst: str) -> None:
        self.calls.append("rename")
        super().rename(src, dst)


@pytest.mark.parametrize("durability", ["full", "fsync", "none"])
def test_durability_orders_syncs_around_rename(tmp_path: Any, durability: str) -> None:
    ops = RecordingOps()
    spilld.save(tmp_path / "f", [], caches(1), durability=durability, ops=ops)
    if durability == "none":
        assert ops.calls == ["rename"]
    else:
        assert ops.calls == [f"fsync:{durability}", "rename", "open_dir", f"fsync:{durability}"]
    assert spilld.load(tmp_path / "f").caches


class FailingOps(fileio.FileOps):
    def __init__(self, fail_on: str) -> None:
        self.fail_on = fail_on

    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        if self.fail_on == "write" and offset > 0:
            raise OSError(28, "No space left on device")
        return super().pwritev(fd, bufs, offset)

    def rename(self, src: str, dst: str) -> None:
        if self.fail_on == "rename":
            raise OSError(5, "Input/output error")
        super().rename(src, dst)


@pytest.mark.parametrize(("fail_on", "err"), [("write", errors.DiskFull), ("rename", errors.StorageError)])
def test_io_errors_are_typed_and_leave_nothing(tmp_path: Any, fail_on: str, err: type[Exception]) -> None:
    with pytest.raises(err) as info:
        spilld.save(tmp_path / "f", [], caches(2), ops=FailingOps(fail_on))
    assert os.listdir(tmp_path) == []
    assert info.value.errno in (28, 5)  # type: ignore[attr-defined]


SHORT_WRITES_MAX_OFFSET = 64 * 1024 * 1024  # past it, a resume that never advances would fill the disk


def _bounded(offset: int) -> None:
    if offset > SHORT_WRITES_MAX_OFFSET:
        raise OSError(27, "File too large")


class ShortWriteOps(fileio.FileOps):
    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        _bounded(offset)
        return os.pwrite(fd, bufs[0][:7], offset)  # at most 7 bytes a call


def test_short_writes_are_resumed(tmp_path: Any) -> None:
    small = [fill(C.KVCache(), 3, heads=1, dim=4)]
    spilld.save(tmp_path / "f", [1, 2, 3], small, ops=ShortWriteOps())
    assert same(live(spilld.load(tmp_path / "f").caches[0]), live(small[0]))


def _first_bytes(bufs: Any, n: int) -> list[memoryview]:
    """The leading ``n`` bytes of a buffer list, as a buffer list (the last one cut)."""
    out = []
    for b in bufs:
        if n <= 0:
            break
        out.append(memoryview(b)[:n])
        n -= out[-1].nbytes
    return out


class ShortVectoredOps(fileio.FileOps):
    """Vectored calls that move an odd number of bytes each (5,001), ending inside one of several buffers."""

    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        _bounded(offset)
        return os.pwritev(fd, _first_bytes(bufs, 5001), offset)

    def preadv(self, fd: int, bufs: Any, offset: int) -> int:
        return os.preadv(fd, _first_bytes(bufs, 5001), offset)


def test_short_vectored_reads_and_writes_across_buffers_are_resumed(tmp_path: Any) -> None:
    data = [memoryview(bytes(range(256)) * k) for k in (3, 1, 40, 2, 7)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        fileio.write_all(ShortVectoredOps(), fd, data, 10, str(tmp_path / "f"))
        back = [memoryview(bytearray(d.nbytes)) for d in data]
        fileio.read_all(ShortVectoredOps(), fd, back, 10, str(tmp_path / "f"))
    finally:
        os.close(fd)
    assert [bytes(b) for b in back] == [bytes(d) for d in data]
    cache = [fill(C.KVCache(), 300, heads=4, dim=8) for _ in range(3)]  # and a whole save and load
    spilld.save(tmp_path / "g", list(range(300)), cache, ops=ShortVectoredOps())
    got = spilld.load(tmp_path / "g", ops=ShortVectoredOps()).caches
    assert all(same(live(a), live(b)) for a, b in zip(got, cache, strict=True))


class PublishOps(fileio.FileOps):
    """Records the file layer's calls of ``publish_all`` by file name, and fails the ``fail``-th call of a kind."""

    def __init__(self, fail: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.names: dict[int, str] = {}
        self.open_now = self.most_open = 0
        self.fail = fail

    def _note(self, kind: str, name: str) -> None:
        self.calls.append((kind, name))
        if self.fail is not None and self.fail[0] == kind and sum(k == kind for k, _ in self.calls) == self.fail[1]:
            raise OSError(28 if kind == "write" else 5, f"injected {kind} failure")

    def open_new(self, path: str, flags: int = 0) -> int:
        fd = super().open_new(path, flags)
        self.names[fd] = path
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        return fd

    def close(self, fd: int) -> None:
        self.open_now -= fd in self.names
        self.names.pop(fd, None)
        super().close(fd)

    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        self._note("write", self.names[fd])
        return super().pwritev(fd, bufs, offset)

    def start_writeback(self, fd: int) -> None:
        self._note("writeback", self.names[fd])
        super().start_writeback(fd)

    def fsync(self, fd: int, durability: fileio.Durability) -> None:
        self._note("fsync", self.names[fd])
        super().fsync(fd, durability)

    def rename(self, src: str, dst: str) -> None:
        self._note("rename", src)
        super().rename(src, dst)


def test_publish_all_writes_every_file_before_any_fsync_and_renames_once_all_are_durable(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fileio, "PUBLISH_AHEAD", 3)
    files = [(str(tmp_path / f"f{i}"), os.urandom(1000 + i)) for i in range(8)]
    ops = PublishOps()
    fileio.publish_all(ops, files, fileio.Durability.FSYNC)
    assert sorted(os.listdir(tmp_path)) == sorted(f"f{i}" for i in range(8))
    for path, data in files:
        with open(path, "rb") as f:
            assert f.read() == data
    kinds = [k for k, _ in ops.calls]
    # each file's writeback is started as it is written; fsyncs trail the writes by PUBLISH_AHEAD files at most
    assert kinds[:8] == ["write", "writeback"] * 4 and kinds.index("fsync") == 8
    assert ops.most_open == 4 and ops.open_now == 0
    fsyncs = [n for k, n in ops.calls if k == "fsync"]
    assert fsyncs == [n for k, n in ops.calls if k == "write"]  # each file's own fd, in order
    assert [n for k, n in ops.calls if k == "writeback"] == fsyncs  # each started on the file just written
    assert max(i for i, c in enumerate(kinds) if c == "fsync") < kinds.index("rename")
    assert [n for k, n in ops.calls if k == "rename"] == fsyncs


def test_publish_all_without_durability_syncs_nothing(tmp_path: Any) -> None:
    ops = PublishOps()
    fileio.publish_all(ops, [(str(tmp_path / "a"), b"a"), (str(tmp_path / "b"), b"b")], fileio.Durability.NONE)
    assert [k for k, _ in ops.calls] == ["write", "write", "rename", "rename"]
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize(
    ("fail", "err"),
    [
        (("write", 3), errors.DiskFull),
        (("writeback", 2), errors.StorageError),
        (("fsync", 2), errors.StorageError),
        (("rename", 2), errors.StorageError),
    ],
)
def test_publish_all_is_all_or_nothing(tmp_path: Any, fail: tuple[str, int], err: type[Exception]) -> None:
    """A failure at any step (a third file's write, a second writeback, a second fsync, the second rename once the
    first is done) is a typed error and leaves no temp file and no published name, and no fd open."""
    before = open_fds()
    ops = PublishOps(fail)
    with pytest.raises(err):
        fileio.publish_all(ops, [(str(tmp_path / f"f{i}"), b"x" * 100) for i in range(4)], fileio.Durability.FSYNC)
    assert os.listdir(tmp_path) == []
    assert ops.open_now == 0 and open_fds() == before


def test_start_writeback_is_quiet_where_it_cannot_and_raises_a_real_error(tmp_path: Any) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"x" * 100_000)
    fileio.start_writeback(fd)
    os.close(fd)
    r, w = os.pipe()
    fileio.start_writeback(w)  # a pipe cannot (ESPIPE): the fsync that follows does the work
    os.close(r)
    os.close(w)
    if fileio.libc_call("sync_file_range", []) is not False:  # Linux
        with pytest.raises(OSError):
            fileio.start_writeback(w)  # closed: EBADF is an error, not a filesystem that cannot
    assert fileio.libc_call("no_such_function_in_any_libc", []) is False


def test_plan_drift_is_caught(tmp_path: Any) -> None:
    # A codec whose source changes size between plan and write.
    cache = fill(C.KVCache(), 9)
    gen = spilld.saver.save_steps(tmp_path / "f", [], [cache])
    step = next(gen)
    assert isinstance(step, TensorStep)
    step.bytes._source = Source(mx.zeros((1, 2, 10, 8)))
    with pytest.raises(errors.PlanDrift):
        step.materialize()
    gen.close()
    assert os.listdir(tmp_path) == []


def test_attachments_and_checkpoint_roundtrip(tmp_path: Any) -> None:
    tokens = list(range(20))
    ck = spilld.GenerationCheckpoint("req-1", "ns", 15, 5, 77, 1234, True)
    att = spilld.Attachment("draft-kv/1", {"layers": 2, "ok": True, "name": "d"}, [mx.arange(6, dtype=mx.int32)])
    spilld.save(tmp_path / "f", tokens, [fill(C.KVCache(), 20)], attachments=[att], checkpoint=ck)
    got = spilld.load(tmp_path / "f")
    assert got.checkpoint == ck
    assert got.attachments[0].schema == "draft-kv/1" and got.attachments[0].metadata == att.metadata
    assert same(got.attachments[0].tensors[0], att.tensors[0])
    assert got.header.trimmable is False  # attachments are never trimmed
    with pytest.raises(errors.CheckpointInconsistent):
        spilld.save(tmp_path / "g", tokens[:3], [fill(C.KVCache(), 3)], checkpoint=ck)


def test_bad_tokens_are_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError):
        spilld.save(tmp_path / "f", [-1], caches(1))
    with pytest.raises(ValueError):
        spilld.save(tmp_path / "f", [2**32], caches(1))
    assert os.listdir(tmp_path) == []


def test_tokens_accept_arrays(tmp_path: Any) -> None:
    spilld.save(tmp_path / "f", mx.arange(5, 22), caches(1))  # as many tokens as the cache holds (17)
    assert spilld.loader.read_header(tmp_path / "f").tokens == list(range(5, 22))


# --- save_async ----------------------------------------------------------------


class AsyncLockLease:
    """The engine decodes on the loop under an asyncio.Lock; a step runs while it is held."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.calls = 0

    async def __call__(self, fn: Callable[[], Any]) -> Any:
        async with self.lock:
            self.calls += 1
            return await asyncio.get_running_loop().run_in_executor(None, fn)


@pytest.mark.asyncio
async def test_save_async_runs_one_step_per_loop_turn(tmp_path: Any) -> None:
    events: list[Any] = []
    stop = False

    async def lease(fn: Callable[[], Any]) -> Any:  # runs the work at once, on the loop: the lease never yields
        work = inspect.unwrap(getattr(fn, "func", fn))  # a write comes wrapped (it says when it starts)
        owner = work.__self__  # type: ignore[attr-defined]  # the save step whose materialize or write this is
        events.append(("step", owner))  # the object itself: kept alive, so no two steps share an id
        return fn()

    async def engine() -> None:  # one decode step per loop turn
        while not stop:
            events.append("turn")
            await asyncio.sleep(0)

    t = asyncio.create_task(engine())
    await asyncio.sleep(0)
    res = await spilld.saver.save_async(tmp_path / "f", list(range(17)), caches(3), run_step=lease, write_in_lease=True)
    stop = True
    await t
    steps = [e for e in events if e != "turn"]
    assert len(steps) == 2 * 6 + 1  # each tensor's materialize and write, then the publish, through the lease
    assert len({id(owner) for _, owner in steps}) == 7
    # Between the last work of one save step and the first of the next, the engine got a turn.
    for a, b in itertools.pairwise(events):
        assert "turn" in (a, b) or a[1] is b[1], "two save steps ran in one loop turn"
    assert res.header.data_bytes == sum(s.nbytes for s in spilld.loader.read_header(tmp_path / "f").slots())


@pytest.mark.asyncio
async def test_save_async_write_in_lease(tmp_path: Any) -> None:
    lease = AsyncLockLease()
    await spilld.saver.save_async(tmp_path / "f", [], caches(2), run_step=lease, write_in_lease=True)
    assert lease.calls == 4 + 5  # 4 materialize + 4 writes + publish
    assert spilld.load(tmp_path / "f").caches


@pytest.mark.asyncio
async def test_failing_lease_aborts_cleanly(tmp_path: Any) -> None:
    n = 0

    async def lease(fn: Callable[[], Any]) -> Any:
        nonlocal n
        n += 1
        if n == 3:
            raise RuntimeError("engine is gone")
        return fn()

    before = open_fds()
    with pytest.raises(RuntimeError, match="engine is gone"):
        await spilld.saver.save_async(tmp_path / "f", [], caches(3), run_step=lease)
    assert os.listdir(tmp_path) == []
    assert open_fds() == before


@pytest.mark.asyncio
async def test_cancelled_save_leaves_nothing(tmp_path: Any) -> None:
    started = asyncio.Event()

    async def lease(fn: Callable[[], Any]) -> Any:
        started.set()
        await asyncio.sleep(0.01)
        return fn()

    task = asyncio.create_task(spilld.saver.save_async(tmp_path / "f", [], caches(4), run_step=lease))
    await started.wait()
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert os.listdir(tmp_path) == []


def received(tokens: list[int], cs: list[Any]) -> tuple[Any, list[Any]]:
    """A plan whose sources are plain bytes, as the daemon receives them."""
    header, sources = spilld.saver.plan(tokens, cs)
    srcs: list[Any] = []
    for i, (slot, src) in enumerate(zip(header.slots(), sources, strict=True)):
        data = b"".join(bytes(r) for r in spilld.saver.TensorBytes(i, slot, src, None).runs_now())
        srcs.append(spilld.saver.BytesSource([data], slot.shape))
    return header, srcs


class CountingLease:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, fn: Callable[[], Any]) -> Any:
        self.calls += 1
        return await asyncio.get_running_loop().run_in_executor(None, fn)


@pytest.mark.asyncio
@pytest.mark.parametrize("tensors_per_batch", [0, 1, 3, 100])
async def test_received_bytes_are_written_in_batches(tmp_path: Any, tensors_per_batch: int) -> None:
    """With ``batch_bytes``, a save of plain bytes takes one lease call per batch of about that many bytes (the
    publish included in the last), not one per step; without it, one per write step. The file is the same."""
    cs = caches(3)  # 6 tensors of the same size
    header, srcs = received(list(range(17)), cs)
    size = header.slots()[0].nbytes
    lease = CountingLease()
    batch = tensors_per_batch * size
    await spilld.saver.save_async(
        tmp_path / "f", [], [], planned=(header, srcs), run_step=lease, write_in_lease=True, batch_bytes=batch
    )
    assert lease.calls == (7 if batch == 0 else -(-6 // tensors_per_batch))
    assert same([live(c) for c in spilld.load(tmp_path / "f").caches], [live(c) for c in cs])


@pytest.mark.asyncio
async def test_a_batchs_deadline_bounds_each_step_not_the_batch(tmp_path: Any) -> None:
    """Ten steps of 0.1 s in one batch outlast a 0.3 s deadline together and are stored; one step of 1 s fails it."""

    class SlowOps(fileio.FileOps):
        delay = 0.1

        def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
            time.sleep(self.delay)
            return super().pwritev(fd, bufs, offset)

    cs = [fill(C.KVCache(), 17, seed=i) for i in range(5)]  # 10 tensors
    ops = SlowOps()
    plan = received(list(range(17)), cs)
    kw: dict[str, Any] = {"ops": ops, "step_deadline": 0.3, "batch_bytes": 1 << 30, "direct": False}
    await spilld.saver.save_async(tmp_path / "f", [], [], planned=plan, **kw)
    assert same([live(c) for c in spilld.load(tmp_path / "f").caches], [live(c) for c in cs])
    ops.delay = 1.0
    with pytest.raises(errors.StorageTimeout):
        await spilld.saver.save_async(tmp_path / "g", [], [], planned=received(list(range(17)), cs), **kw)
    await asyncio.sleep(1.2)  # the late step returns; its file is cleaned up
    assert sorted(os.listdir(tmp_path)) == ["f"]


@pytest.mark.asyncio
async def test_a_saves_cleanup_off_the_loop_is_logged_when_it_fails_and_runs_here_when_no_thread_can(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review of the close moved off the loop: a cleanup that raised was never retrieved ("Future exception
    was never retrieved"), and at interpreter exit no thread may start, so the cleanup did not run at all."""
    import importlib

    drive = importlib.import_module("spilld.saver.drive")  # (the package's ``drive`` is a function of it)
    closed: list[str] = []

    def steps(fail: bool) -> Any:
        try:
            yield 1
        finally:
            closed.append("closed")
            if fail:
                raise OSError("the temp file could not be removed")

    loop = asyncio.get_running_loop()
    failing = steps(True)
    next(failing)
    with caplog.at_level(logging.WARNING, logger="spilld.saver"):
        await drive._close_off_loop(loop, failing)
    assert closed == ["closed"] and any("cleanup failed" in r.getMessage() for r in caplog.records)

    def no_thread(*a: Any) -> Any:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(loop, "run_in_executor", no_thread)
    exiting = steps(False)
    next(exiting)
    await drive._close_off_loop(loop, exiting)
    assert closed == ["closed", "closed"]
