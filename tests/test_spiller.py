"""Embedded mode end to end with a real tiny model: spill, restart, restore; checkpoints; barriers."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import mlx.core as mx
import pytest
import uvloop

import spilld
import spilld.saver
from spilld import Outcome, mlxthreads
from tests.models import next_logits, prefill, random_tokens, tiny_llama

pytestmark = pytest.mark.asyncio


def ident(model: Any) -> spilld.Identity:
    return spilld.model_identity(model, model_id="tiny-llama")


async def test_spill_restart_restore_gives_identical_logits(tmp_path: Any) -> None:
    model = tiny_llama()
    prompt = random_tokens(48, seed=3)
    cache, _ = prefill(model, prompt)
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model))
    fut = sp.spill(prompt, cache)
    assert isinstance(fut, asyncio.Future)
    live = next_logits(model, cache, 11)  # the engine goes on with its cache
    assert (await fut).outcome is Outcome.STORED
    await sp.close()

    again = await spilld.Spiller.open(tmp_path, identity=ident(model))  # a restart
    follow_up = [*prompt, 11, 12, 13]
    got = await again.load(follow_up)
    assert got is not None and got.tokens == prompt
    assert mx.array_equal(next_logits(model, got.caches, 11), live).item()
    assert again.stats()["store"]["hits"] == 1
    # a different model's spiller on the same folder never sees it
    other = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("other", "fp", "", ""))
    assert await other.load(follow_up) is None


async def test_spill_from_the_engine_thread(tmp_path: Any) -> None:
    model = tiny_llama()
    prompt = random_tokens(20)
    lock = threading.Lock()
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model), lease=spilld.ThreadLockLease(lock))
    out: list[Any] = []

    def engine() -> None:  # mlx-lm's server decodes in its own thread, under its generation lock
        with lock:
            cache, _ = prefill(model, prompt)
            out.append(sp.spill_threadsafe(prompt, cache))

    th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    await asyncio.get_running_loop().run_in_executor(None, th.join)
    settled = await asyncio.wrap_future(out[0])
    assert settled.stored and (await sp.drain()).done
    assert isinstance(await sp.lookup([*prompt, 1]), spilld.Hit)


async def test_barrier_runs_after_earlier_writes(tmp_path: Any) -> None:
    model = tiny_llama()
    cache, _ = prefill(model, random_tokens(16))
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model))
    seen: list[int] = []
    w = sp.spill(random_tokens(16), cache, key="g1")
    b = sp.barrier("g1", action=lambda: seen.append(sp.store.counters.stored))
    assert (await w).stored and (await b).stored and seen == [1]


def sample(logits: mx.array, seed: int, step: int, temp: float = 1.0) -> int:
    """A temperature sampler whose randomness depends only on (seed, step)."""
    return int(mx.random.categorical(logits / temp, key=mx.random.key(seed * 100_003 + step)).item())


def generate(
    model: Any, prompt: list[int], n: int, seed: int, *, resume: Any = None, stop_at: int | None = None
) -> tuple[list[int], Any]:
    """Emit n tokens; with ``stop_at`` return early with the state a checkpoint needs."""
    if resume is None:
        cache, logits = prefill(model, prompt)
        out: list[int] = []
        tok = sample(logits, seed, 0)
    else:
        cache, out, tok = resume.caches, list(resume.tokens[len(prompt) :]), resume.checkpoint.pending_token
    while len(out) < n:
        if stop_at is not None and len(out) == stop_at:
            return out, (cache, tok)
        out.append(tok)
        logits = next_logits(model, cache, tok)
        tok = sample(logits, seed, len(out))
    return out, None


async def test_generation_checkpoint_resumes_identically(tmp_path: Any) -> None:
    model = tiny_llama()
    prompt = random_tokens(24, seed=9)
    seed = 4242
    full, _ = generate(model, prompt, 16, seed)
    assert len(set(full)) > 3  # a temperature sampler, not one repeated token

    emitted, (cache, pending) = generate(model, prompt, 16, seed, stop_at=7)  # type: ignore[misc]
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model))
    ck = spilld.GenerationCheckpoint("req-7", "", len(prompt), len(emitted), pending, seed, True)
    assert (await sp.checkpoint([*prompt, *emitted], cache, ck)).stored
    live_next = next_logits(model, cache, pending)
    await sp.close()

    restarted = await spilld.Spiller.open(tmp_path, identity=ident(model))
    assert isinstance(await restarted.lookup([*prompt, *emitted, 1]), spilld.Miss)  # checkpoints stay apart
    got = await restarted.resume("req-7")
    assert got is not None and got.checkpoint == ck
    fresh = await restarted.resume("req-7")
    assert fresh is not None and mx.array_equal(next_logits(model, fresh.caches, pending), live_next).item()
    resumed, _ = generate(model, prompt, 16, seed, resume=got)
    assert resumed == full
    # a wrong seed or a lost pending token would show
    assert generate(model, prompt, 16, seed + 1, resume=await restarted.resume("req-7"))[0] != full

    assert (await restarted.finish("req-7")).stored
    assert await restarted.resume("req-7") is None


async def test_newer_checkpoint_cancels_queued_older_ones(tmp_path: Any) -> None:
    model = tiny_llama()
    prompt = random_tokens(10)
    cache, _ = prefill(model, prompt)
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model))
    ck = spilld.GenerationCheckpoint("k", "", 10, 0, 1, 1, False)
    first = sp.checkpoint(prompt, cache, ck)
    second = sp.checkpoint(prompt, cache, ck)
    third = sp.checkpoint(prompt, cache, ck)
    outcomes = [(await f).outcome for f in (first, second, third)]
    assert outcomes[-1] is Outcome.STORED and Outcome.CANCELLED in outcomes


def _address(a: mx.array) -> int:
    import numpy as np

    return int(np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]


async def test_live_snapshot_does_not_make_the_engine_copy(tmp_path: Any) -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill, kv, live

    cache = fill(C.KVCache(), 40)
    before = live(fill(C.KVCache(), 40))  # the same data, from a twin (a view of ours would pin the buffer)
    lock = threading.Lock()  # the engine's: live rows are read only while it is free
    sp = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=spilld.ThreadLockLease(lock))
    fut = sp.spill(list(range(40)), [cache], live=True)
    addr = _address(cache.keys)
    for i in range(5):  # the engine keeps extending its cache in place
        with lock:
            cache.update_and_fetch(*kv(1, seed=50 + i))
            mx.eval(cache.keys, cache.values)
    assert _address(cache.keys) == addr  # no copy: nothing of ours pinned the buffer
    assert (await fut).stored
    got = await sp.load([*range(40), 7])
    assert got is not None and got.tokens == list(range(40))
    from tests.caches import same

    assert same(live(got.caches[0]), before)


async def test_live_snapshot_detects_a_cut_below_its_length(tmp_path: Any) -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill

    cache = fill(C.KVCache(), 30)
    lease = spilld.ThreadLockLease(threading.Lock())
    sp = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=lease)
    fut = sp.spill(list(range(30)), [cache], live=True)
    cache.trim(10)
    res = await fut
    assert res.outcome is Outcome.FAILED and isinstance(res.error, spilld.errors.PlanDrift)
    assert sp.store.entries == [] and not any(f.endswith(".spilld") for _, _, fs in os.walk(tmp_path) for f in fs)


async def test_live_snapshot_of_a_model_decoding_on_its_own_thread(tmp_path: Any) -> None:
    """A real model decodes on its own thread under its generation lock, after the spill and while it is written."""
    model = tiny_llama()
    prompt = random_tokens(30, seed=5)
    lock, decoded = threading.Lock(), threading.Event()
    events: list[str] = []
    held = spilld.ThreadLockLease(lock)

    async def lease(fn: Any) -> Any:  # the engine's lock, taken only once the engine has decoded past the call
        await asyncio.get_running_loop().run_in_executor(None, decoded.wait, 60)

        def step() -> Any:
            events.append("write")  # inside the engine's lock: no decode step may run until "written"
            try:
                return fn()
            finally:
                events.append("written")

        return await held(step)

    sp = await spilld.Spiller.open(tmp_path, identity=ident(model), lease=lease)
    out: dict[str, Any] = {}

    def engine() -> None:
        with lock:
            cache, _ = prefill(model, prompt)
            fut = sp.spill_threadsafe(prompt, cache, live=True)
        for step in range(200):
            if step >= 3 and fut.done():
                break
            with lock:
                events.append("decode")
                next_logits(model, cache, 3 + step % 50)
            if step == 2:
                decoded.set()
        out["settled"] = fut.result(timeout=60)

    await asyncio.get_running_loop().run_in_executor(None, engine)
    assert out["settled"].stored
    assert events[:3] == ["decode"] * 3 and "write" in events  # the write ran after decode steps it had to survive
    writing = False
    for e in events:  # and never during one
        assert not (writing and e == "decode"), events
        writing = {"write": True, "written": False}.get(e, writing)
    got = await sp.load([*prompt, 3])
    assert got is not None and got.tokens == prompt
    fresh, _ = prefill(model, prompt)
    assert mx.array_equal(next_logits(model, got.caches, 3), next_logits(model, fresh, 3)).item()
    await sp.close()


async def test_live_rows_are_copied_in_chunks_across_engine_steps(tmp_path: Any) -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill, kv, live, same

    cache = fill(C.KVCache(), 300, heads=4, dim=64)  # 2 x 300 KiB tensors
    want = live(fill(C.KVCache(), 300, heads=4, dim=64))
    calls = 0

    async def lease(fn: Any) -> Any:
        nonlocal calls
        calls += 1
        out = fn()
        # the engine runs a step between two lease holds, and at 400 tokens grows into a new buffer
        for i in range(40):
            cache.update_and_fetch(*kv(1, heads=4, dim=64, seed=1000 + calls * 50 + i))
        mx.eval(cache.keys, cache.values)
        return out

    plan = spilld.saver.plan(list(range(300)), [cache], live=True)
    res = await spilld.saver.save_async(tmp_path / "f", [], [], run_step=lease, planned=plan, live_chunk=64 * 1024)
    assert calls >= 2 * 5 and cache.keys.shape[2] > 512  # several holds per tensor; the buffer was regrown
    got = spilld.load(res.path).caches[0]
    assert same(live(got), want)


async def test_a_restore_does_no_file_io_on_the_engines_loop(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mtime of a hit, and the move of a corrupt file into the quarantine, run on worker threads."""
    model = tiny_llama()
    prompt = random_tokens(24, seed=5)
    cache, _ = prefill(model, prompt)
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model))
    assert (await sp.spill(prompt, cache)).stored
    on_loop: list[str] = []
    loop_thread = threading.current_thread()

    def watch(name: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is loop_thread:
                on_loop.append(name)
            return fn(*a, **kw)

        return call

    for name in ("utime", "rename", "makedirs"):
        monkeypatch.setattr(os, name, watch(name, getattr(os, name)))
    monkeypatch.setattr(os.path, "exists", watch("exists", os.path.exists))
    got = await sp.load([*prompt, 1])
    assert got is not None and got.tokens == prompt
    hit = await sp.lookup([*prompt, 1])
    assert isinstance(hit, spilld.Hit)
    with open(hit.path, "r+b") as f:  # a byte of tensor data flipped: the next restore quarantines the file
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert await sp.load([*prompt, 1]) is None
    assert sp.stats()["store"]["quarantined"] == 1
    assert on_loop == [], on_loop
    await sp.close()


class _UnlinkOnThread(spilld.fileio.FileOps):
    """Records the thread of each unlink."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def unlink(self, path: str) -> None:
        self.threads.append(threading.current_thread().name)
        super().unlink(path)


class _PinsFileFails(spilld.fileio.FileOps):
    def rename(self, src: str, dst: str) -> None:
        if dst.endswith(".spilld-pins"):
            raise OSError(5, "Input/output error")
        super().rename(src, dst)


@pytest.mark.asyncio
async def test_finish_unlinks_off_the_loop_and_a_failed_pins_file_is_not_a_failed_spill(tmp_path: Any) -> None:
    """Both found in review: finish removed a generation's checkpoints on the engine's loop thread (a slow disk
    stalled it), and a pinned spill whose pins file could not be written was reported FAILED although its entry
    was durable, indexed and served."""
    from mlx_lm.models import cache as C

    from spilld import format as fmt
    from tests.caches import fill

    ident = spilld.Identity("m", "cfg", "tok", "")
    async with spilld.Spiller(str(tmp_path / "a"), identity=ident, block_tokens=0) as sp:
        ops = _UnlinkOnThread()
        sp.store.ops = ops
        cp = fmt.GenerationCheckpoint("gen1", "", 60, 4, 4242, 7, True)
        assert (await sp.checkpoint(list(range(64)), [fill(C.KVCache(), 64)], cp)).outcome is Outcome.STORED
        assert (await sp.finish("gen1")).outcome is Outcome.STORED and await sp.resume("gen1") is None
        assert ops.threads and threading.main_thread().name not in ops.threads
    async with spilld.Spiller(str(tmp_path / "b"), identity=ident, block_tokens=0) as sp:
        sp.store.ops = _PinsFileFails()
        got = await sp.spill(list(range(64)), [fill(C.KVCache(), 64)], droppable=False, pin=True)
        assert got.outcome is Outcome.STORED and len(sp.store.entries) == 1
        assert isinstance(await sp.lookup([*range(64), 1]), spilld.Hit)


@pytest.mark.asyncio
async def test_a_threadsafe_spill_whose_caller_cancelled_its_future_logs_no_error(tmp_path: Any) -> None:
    """Found in review: setting the result of a future its caller had cancelled raised in a loop callback."""
    from mlx_lm.models import cache as C

    from tests.caches import fill

    loop = asyncio.get_running_loop()
    errors_seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, ctx: errors_seen.append(ctx))
    try:
        async with spilld.Spiller(str(tmp_path), identity=spilld.Identity("m"), block_tokens=0) as sp:
            fut = await asyncio.to_thread(sp.spill_threadsafe, list(range(16)), [fill(C.KVCache(), 16)])
            fut.cancel()
            assert (await sp.drain(10)).done
            await asyncio.sleep(0.05)
        assert errors_seen == []
    finally:
        loop.set_exception_handler(None)


@pytest.mark.asyncio
async def test_a_cancelled_close_keeps_the_folders_lock_until_the_writer_has_ended(tmp_path: Any) -> None:
    """Found in review: a close cancelled during its drain let the folder's lock go at once, while the writer went
    on writing the spills queued before it: into a folder another spilld could then own (and scan, and reap)."""
    from mlx_lm.models import cache as C

    from tests.caches import fill

    gate = threading.Event()
    unlocked: list[int] = []

    def free() -> bool:
        return _lock_free(tmp_path)

    async def lease(fn: Any) -> Any:
        await spilld.lease.off_loop(lambda: gate.wait(10))
        if free():
            unlocked.append(1)
        return await spilld.lease.off_loop(fn)

    sp = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=lease)
    futs = [sp.spill(list(range(100 * i, 100 * i + 32)), [fill(C.KVCache(), 32, seed=i)]) for i in range(3)]
    closing = asyncio.ensure_future(sp.close())
    await asyncio.sleep(0.05)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not free()
    gate.set()
    assert [r.outcome for r in await asyncio.wait_for(asyncio.gather(*futs), 10)] == [Outcome.STORED] * 3
    assert unlocked == []
    await asyncio.sleep(0.05)
    assert free()  # let go once the writer ended


def _lock_free(folder: Any) -> bool:
    """Whether nobody holds ``folder``'s lock (another spilld could own it now)."""
    from spilld.lockfile import LOCK_NAME, FileLock

    probe = FileLock(str(folder / LOCK_NAME), "probe")
    if probe.try_acquire():
        probe.release()
        return True
    return False


class _HungWearFile(spilld.fileio.FileOps):
    """A disk that hangs on the wear file's write until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def open_new(self, path: str, flags: int = 0) -> int:
        if ".spilld-wear" in path:
            self.release.wait(60)
        return super().open_new(path, flags)


@pytest.mark.asyncio
async def test_a_close_keeps_to_its_timeout_while_the_wear_file_hangs(tmp_path: Any) -> None:
    """Found in review: close gave the wear record what was left of its timeout through ``wait_for``, whose cancel
    waited for the record's thread: ``close(timeout=1)`` took as long as the hung write of the wear file."""
    from mlx_lm.models import cache as C

    from spilld.store import Store
    from tests.caches import fill

    sp = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"))
    assert (await sp.spill(list(range(16)), [fill(C.KVCache(), 16)])).stored
    written = sp.store.stats()["written_day"]
    sp.store.ops = hung = _HungWearFile()
    closing = asyncio.ensure_future(sp.close(timeout=0.5))
    try:
        done, _ = await asyncio.wait([closing], timeout=5)
        assert closing in done
        await asyncio.sleep(0.1)
        assert not _lock_free(tmp_path)  # found in review: let go before the record landed, a successor's count short
    finally:
        hung.release.set()
        await closing
    assert sp._records
    await asyncio.wait(sp._records, timeout=10)  # the record went on alone, and landed once the disk came back
    await asyncio.sleep(0)
    assert _lock_free(tmp_path)  # then the lock goes
    again = Store(tmp_path)
    again.scan()
    assert again.stats()["written_day"] == written > 0


@pytest.mark.asyncio
async def test_a_cancelled_close_records_the_runs_wear(tmp_path: Any) -> None:
    """Found in review: a close cancelled while it drained never added the run's bytes to the wear file, so the
    next run's write budget lost them. Those written before the cancel are recorded before it goes on; those the
    writer still writes after it (the items queued before the close) once the writer ends."""
    from mlx_lm.models import cache as C

    from spilld.store import Store
    from tests.caches import fill

    gate = threading.Event()
    gate.set()

    async def lease(fn: Any) -> Any:
        await spilld.lease.off_loop(lambda: gate.wait(10))
        return await spilld.lease.off_loop(fn)

    def recorded() -> int:
        again = Store(tmp_path)
        again.scan()
        return int(again.stats()["written_day"])

    sp = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=lease)
    assert (await sp.spill(list(range(32)), [fill(C.KVCache(), 32)])).stored
    before = sp.store.stats()["written_day"]
    gate.clear()  # the next two wait in their write
    futs = [sp.spill(list(range(100 * i, 100 * i + 32)), [fill(C.KVCache(), 32, seed=i)]) for i in (1, 2)]
    closing = asyncio.ensure_future(sp.close())
    await asyncio.sleep(0.05)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert recorded() == before > 0
    gate.set()
    assert [r.outcome for r in await asyncio.wait_for(asyncio.gather(*futs), 10)] == [Outcome.STORED] * 2
    end = time.monotonic() + 10
    while recorded() < sp.store.stats()["written_day"] and time.monotonic() < end:  # the writer ends, then records
        await asyncio.sleep(0.05)  # what it wrote since
    assert recorded() == sp.store.stats()["written_day"] > before


async def test_a_threadsafe_spill_settles_when_its_loop_stops_without_a_close(tmp_path: Any) -> None:
    """Found in review: the Spiller's loop stopped (its thread ended) with no close, and the engine thread waited
    for ever on the futures of its spills still queued or in their write, and of any made after. Each settles
    cancelled with ``Closed``: those handed over before the stop, or after it, once it is seen; those after the
    loop's close at once."""
    uv = isinstance(asyncio.get_running_loop(), uvloop.Loop)  # the Spiller's loop of the same kind as the test's
    await asyncio.to_thread(_engine_outlives_its_spillers_loop, tmp_path, uvloop.new_event_loop if uv else None)


def _engine_outlives_its_spillers_loop(tmp_path: Any, new_loop: Any) -> None:
    from mlx_lm.models import cache as C

    from spilld.queue import Settled
    from tests.caches import fill

    loop = (new_loop or asyncio.new_event_loop)()
    th = mlxthreads.start_thread(loop.run_forever, "spiller-loop", daemon=True)
    gate = threading.Event()

    async def lease(fn: Any) -> Any:  # the write waits until the end of the test
        await spilld.lease.off_loop(lambda: gate.wait(20))
        return await spilld.lease.off_loop(fn)

    def closed(r: Settled) -> bool:
        return r.outcome is Outcome.CANCELLED and isinstance(r.error, spilld.errors.Closed)

    try:
        opening = spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=lease)
        sp = asyncio.run_coroutine_threadsafe(opening, loop).result(30)
        cache = fill(C.KVCache(), 16)
        waiting = [sp.spill_threadsafe(list(range(i, i + 16)), [cache]) for i in range(3)]
        end = time.monotonic() + 10
        while sp.queue.pending_items < 3 and time.monotonic() < end:  # one in its write, two queued behind it
            time.sleep(0.01)
        waiting.append(sp.spill_threadsafe(list(range(50, 66)), [cache]))  # handed over as the loop stops
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        assert not th.is_alive()
        assert all(closed(f.result(timeout=5)) for f in waiting)
        after = sp.spill_threadsafe(list(range(100, 116)), [cache])
        assert closed(after.result(timeout=5))  # once the watch sees the loop still stopped
        gate.set()
        _wind_down(loop)
        assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
        loop.close()
        after_close = sp.spill_threadsafe(list(range(200, 216)), [cache])
        assert after_close.done() and closed(after_close.result())
    finally:
        gate.set()
        if not loop.is_closed():
            if th.is_alive():  # (a stop asked of a loop not running would end the wind-down's run instead)
                loop.call_soon_threadsafe(loop.stop)
                th.join(10)
            if not th.is_alive():
                _wind_down(loop)
            loop.close()


def _wind_down(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a stopped loop still runs and let it unwind, as ``asyncio.run`` does before it closes its loop.
    Found in the full suite: the queue's writer, left in its write's wait on a thread when the loop stopped, stayed
    pending on the closed loop, and was reported destroyed while pending when the garbage collector took it."""
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


async def test_a_threadsafe_spill_handed_before_the_loop_runs_is_stored(tmp_path: Any) -> None:
    """A loop not running yet is not a stopped one: a Spiller opened with ``run_until_complete``, its loop then run
    by a thread of its own, takes a spill handed over in between (the thread that ran the loop lives on)."""
    await asyncio.to_thread(_handed_before_the_loop_runs, tmp_path)


def _handed_before_the_loop_runs(tmp_path: Any) -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill

    loop = asyncio.new_event_loop()
    sp = loop.run_until_complete(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m")))
    fut = sp.spill_threadsafe(list(range(16)), [fill(C.KVCache(), 16)])  # the loop does not run now
    time.sleep(5 * spilld.snapshot.LOOP_WATCH_S)  # the watch has looked, and the thread that ran the loop lives
    th = mlxthreads.start_thread(loop.run_forever, "spiller-loop", daemon=True)
    try:
        assert fut.result(timeout=10).stored
    finally:
        asyncio.run_coroutine_threadsafe(sp.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        loop.close()


async def test_an_on_loop_spill_behind_a_write_behind_still_queued_is_kept_not_written_twice(tmp_path: Any) -> None:
    """``spill(..., behind=)`` on the loop's thread, as ``spill_threadsafe``'s (one API with the clients'): a later spill
    of the same entry naming a droppable one still queued keeps that one, made not droppable, and is written once."""
    model = tiny_llama()
    prompt = random_tokens(24, seed=5)
    cache, _ = prefill(model, prompt)
    prompt2 = random_tokens(24, seed=6)
    cache2, _ = prefill(model, prompt2)
    sp = await spilld.Spiller.open(tmp_path, identity=ident(model))
    try:
        first = sp.spill(prompt, cache)  # queued: the writer has not run yet
        kept = sp.spill(prompt, cache, droppable=False, behind=first)
        other = sp.spill(prompt2, cache2, droppable=False, behind=first)  # not the same entry: queued
        assert sp.queue.pending_items == 2 and not sp.queue._queue[0].item.droppable
        assert all(r.stored for r in [await first, await kept, await other]) and (await kept) == (await first)
        assert sp.queue.stored == 2 and sp.store.counters.superseded == 0
    finally:
        await sp.close()
