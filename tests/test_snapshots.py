"""A snapshot is the state at the ``spill()`` call, whatever the engine does before it is written.

A real engine thread spills (to a ``Spiller`` on a loop thread, or to the daemon through ``Client``) and then
decodes many steps before the write may start, and goes on decoding while it runs; every loaded byte is compared
with a copy taken at the call. With the lease (``live=True`` reads append-only rows inside it) and without (no
exclusion: everything is cloned at the call).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import mlxthreads, saver
from spilld.client import Client
from spilld.codecs import base
from spilld.lease import NoLease, ThreadLockLease
from spilld.loopthread import LoopThread
from spilld.queue import Outcome, Settled
from tests.caches import fill, kv, live
from tests.daemons import Daemon, serving

STEPS_BEFORE_WRITE = 40  # decode steps between the spill call and the first write step
MAX_STEPS_DURING = 400  # the engine keeps decoding while the write runs (bounded)


def _quantized() -> Any:
    return fill(C.QuantizedKVCache(group_size=32, bits=4), 30, dim=64)


def _arrays() -> Any:
    c = C.ArraysCache(2)
    c[0] = mx.random.normal((1, 3, 16))
    c[1] = mx.random.normal((1, 4, 8))
    mx.eval(c.cache)
    return c


def _arrays_step(c: Any, i: int) -> None:
    c[0] = c[0] * 0.5 + mx.random.normal((1, 3, 16))  # a new state, as an SSM layer sets it
    c.cache[1] += 1.0  # and one updated in place (rebinds the very array object)


def _kv_step(dim: int = 8, batch: int = 1, heads: int = 2) -> Callable[[Any, int], None]:
    def step(c: Any, i: int) -> None:
        c.update_and_fetch(*kv(1, heads=heads, dim=dim, batch=batch, seed=5000 + i))

    return step


def _chunked_step(c: Any, i: int) -> None:
    c.maybe_trim_front()
    c.update_and_fetch(*kv(1, seed=7000 + i))


def _list_step(c: Any, i: int) -> None:
    for child in c.caches:
        child.update_and_fetch(*kv(1, seed=9000 + i))


def _batch_rot() -> Any:
    c = C.BatchRotatingKVCache(max_size=16, left_padding=[2, 0])
    c.update_and_fetch(*kv(20, batch=2))
    return c


# name -> (a cache as the engine holds it, one decode step)
CLASSES: dict[str, tuple[Callable[[], Any], Callable[[Any, int], None]]] = {
    "kv": (lambda: fill(C.KVCache(), 40), _kv_step()),
    "quantized": (_quantized, _kv_step(dim=64)),
    "concat": (lambda: fill(C.ConcatenateKVCache(), 20), _kv_step()),
    "rotating_wrapped": (lambda: fill(C.RotatingKVCache(max_size=64, keep=4), 200, chunk=150), _kv_step()),
    "rotating_prefilled": (lambda: fill(C.RotatingKVCache(max_size=64, keep=4), 200), _kv_step()),
    "rotating_wraps_later": (lambda: fill(C.RotatingKVCache(max_size=64, keep=4), 40), _kv_step()),
    "chunked": (lambda: fill(C.ChunkedKVCache(chunk_size=16), 20), _chunked_step),
    "arrays": (_arrays, _arrays_step),
    "cachelist": (lambda: C.CacheList(fill(C.KVCache(), 9), fill(C.RotatingKVCache(16, keep=2), 30)), _list_step),
    "batch_kv": (
        lambda: C.BatchKVCache.merge([fill(C.KVCache(), 7), fill(C.KVCache(), 12, seed=3)]),
        _kv_step(batch=2),
    ),
    "batch_rotating": (_batch_rot, _kv_step(batch=2)),
}


def tokens_in(cache: Any) -> int:
    """How many token ids a file of this cache records (at least as many as it encodes)."""
    if isinstance(cache, C.CacheList):
        return max(tokens_in(c) for c in cache.caches)
    if isinstance(cache, C.BatchKVCache):
        return int(cache._idx)
    if isinstance(cache, C.BatchRotatingKVCache):
        return int(cache._offset)
    n = getattr(cache, "offset", None)
    return int(n) if isinstance(n, int) and n > 0 else 1


def freeze(x: Any) -> Any:
    """A deep copy of nested arrays as numpy (a copy no later mlx update can reach)."""
    if isinstance(x, mx.array):
        return np.array(x, copy=True)
    if isinstance(x, (list, tuple)):
        return [freeze(v) for v in x]
    if isinstance(x, dict):
        return {k: freeze(v) for k, v in x.items()}
    return x


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return bool(a == b)


class Gate:
    """Holds back the write's first step until the engine has decoded past the snapshot point."""

    def __init__(self) -> None:
        self.open = threading.Event()

    async def wait(self) -> None:
        import asyncio

        while not self.open.is_set():
            await asyncio.sleep(0.001)


class GatedLease(ThreadLockLease):
    def __init__(self, lock: threading.Lock, gate: Gate) -> None:
        super().__init__(lock)
        self.gate = gate

    async def __call__(self, fn: Callable[[], Any], /) -> Any:  # type: ignore[override]
        await self.gate.wait()
        return await super().__call__(fn)


class GatedNoLease(NoLease):
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def __call__(self, fn: Callable[[], Any], /) -> Any:  # type: ignore[override]
        await self.gate.wait()
        return await super().__call__(fn)


def run_engine(
    spill: Callable[..., Any],
    make: Callable[[], Any],
    step: Callable[[Any, int], None],
    lock: threading.Lock,
    gate: Gate,
    lazy_every: int = 0,
) -> tuple[Any, Settled, int]:
    """On a thread of its own: build the cache, spill it live, decode past the gate, keep decoding until it settles.

    With ``lazy_every=k`` every k-th step leaves its work unevaluated when it releases the lock (the next one
    evaluates it), as a pipelined engine may.
    """

    def decode(i: int) -> None:
        with lock:
            step(cache, i)
            if not lazy_every or i % lazy_every:
                mx.eval(live(cache))

    out: dict[str, Any] = {}

    cache = None

    def engine() -> None:
        nonlocal cache
        try:
            cache = make()
            with lock:
                out["want"] = freeze(live(cache))  # the copy taken at the call
                fut = spill(list(range(tokens_in(cache))), [cache], live=True, droppable=False)
            steps = 0
            for steps in range(STEPS_BEFORE_WRITE):
                decode(steps)
            gate.open.set()
            while not fut.done() and steps < STEPS_BEFORE_WRITE + MAX_STEPS_DURING:
                steps += 1
                decode(steps)
                time.sleep(0.0005)  # the gap between two decode steps
            out["steps"] = steps
            out["settled"] = fut.result(timeout=120)
        except BaseException as exc:  # reported on the test's thread
            out["error"] = exc

    th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    th.join(timeout=300)
    if "error" in out:
        raise out["error"]
    return out["want"], out["settled"], out["steps"]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "256MiB") as d:
        yield d


def _lease(leased: bool, lock: threading.Lock, gate: Gate) -> Any:
    return GatedLease(lock, gate) if leased else GatedNoLease(gate)


def _spill_in_process(tmp_path: Any, name: str, leased: bool) -> tuple[Any, Settled, str]:
    make, step = CLASSES[name]
    lock, gate = threading.Lock(), Gate()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=_lease(leased, lock, gate)))
        want, settled, _ = run_engine(sp.spill_threadsafe, make, step, lock, gate)
        lt.run(sp.close())
    finally:
        lt.stop()
    path = settled.value.path if settled.stored else ""
    return want, settled, path


def _spill_through_daemon(daemon: Daemon, name: str, leased: bool) -> tuple[Any, Settled, str]:
    make, step = CLASSES[name]
    lock, gate = threading.Lock(), Gate()
    client = Client(daemon.socket, identity=spilld.Identity(f"m-{name}-{leased}"), lease=_lease(leased, lock, gate))
    try:
        want, settled, _ = run_engine(client.spill, make, step, lock, gate)
    finally:
        client.close()
    return want, settled, settled.value.path if settled.stored else ""


@pytest.mark.parametrize("leased", [True, False], ids=["lease", "no_lease"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_in_process_snapshot_is_the_state_at_the_call(tmp_path: Any, name: str, leased: bool) -> None:
    want, settled, path = _spill_in_process(tmp_path, name, leased)
    assert settled.outcome is Outcome.STORED, settled.error
    assert equal(freeze(live(spilld.load(path).caches[0])), want)


@pytest.mark.parametrize("leased", [True, False], ids=["lease", "no_lease"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_daemon_snapshot_is_the_state_at_the_call(daemon: Daemon, name: str, leased: bool) -> None:
    want, settled, path = _spill_through_daemon(daemon, name, leased)
    assert settled.outcome is Outcome.STORED, settled.error
    assert equal(freeze(live(spilld.load(path).caches[0])), want)


def test_the_engine_decodes_while_a_live_write_runs(tmp_path: Any) -> None:
    """The write takes the lease piece by piece: the engine's steps go on between them."""
    lock, gate = threading.Lock(), Gate()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=GatedLease(lock, gate)))
        want, settled, steps = run_engine(
            sp.spill_threadsafe, lambda: fill(C.KVCache(), 3000, heads=8, dim=64), _kv_step(dim=64, heads=8), lock, gate
        )  # 2 x 6 MiB: several 2 MiB pieces per tensor
        lt.run(sp.close())
    finally:
        lt.stop()
    assert settled.stored and steps > STEPS_BEFORE_WRITE  # decode steps ran while the write did
    assert equal(freeze(live(spilld.load(settled.value.path).caches[0])), want)


def test_live_snapshot_while_the_engine_leaves_some_steps_unevaluated(tmp_path: Any) -> None:
    """A hold that finds the engine's buffer still a graph (only the engine's thread can evaluate it) waits for
    the next one; it never fails the write nor reads anything else."""
    lock, gate = threading.Lock(), Gate()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=GatedLease(lock, gate)))
        make, step = CLASSES["kv"]
        want, settled, _ = run_engine(sp.spill_threadsafe, make, step, lock, gate, lazy_every=2)
        lt.run(sp.close())
    finally:
        lt.stop()
    assert settled.stored, settled.error
    assert equal(freeze(live(spilld.load(settled.value.path).caches[0])), want)


# --- the engine's own objects are read on its thread, inside spill() ------------------------------------------------


def _spill_from_engine_thread(
    tmp_path: Any, make_args: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]
) -> Settled:
    """A Spiller on a loop thread; the engine builds its (lazy) objects and spills from its own thread."""
    lt = LoopThread("spiller")
    out: dict[str, Any] = {}
    try:
        lease = ThreadLockLease(threading.Lock())
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=lease))

        def engine() -> None:
            try:
                args, kw = make_args()  # built on the engine's thread, as an engine does
                out["fut"] = sp.spill_threadsafe(*args, **kw)
            except BaseException as exc:
                out["error"] = exc

        th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
        th.join()
        if "error" in out:
            raise out["error"]
        settled: Settled = out["fut"].result(timeout=60)
        lt.run(sp.close())
    finally:
        lt.stop()
    return settled


def test_tokens_given_as_an_mlx_array(tmp_path: Any) -> None:
    settled = _spill_from_engine_thread(tmp_path, lambda: ((mx.arange(12) * 2, [fill(C.KVCache(), 12)]), {}))
    assert settled.stored, settled.error
    assert spilld.load(settled.value.path).tokens == list(range(0, 24, 2))


def test_lazy_attachments(tmp_path: Any) -> None:
    def args() -> tuple[tuple[Any, ...], dict[str, Any]]:
        draft = spilld.Attachment("draft", {"n": 6}, [mx.arange(6, dtype=mx.float32) * 3])  # lazy
        return (list(range(12)), [fill(C.KVCache(), 12)]), {"attachments": [draft]}

    settled = _spill_from_engine_thread(tmp_path, args)
    assert settled.stored, settled.error
    got = spilld.load(settled.value.path).attachments[0]
    assert got.tensors[0].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]


def test_an_attachment_updated_in_place_after_the_spill(tmp_path: Any) -> None:
    draft = mx.arange(8, dtype=mx.float32)
    mx.eval(draft)
    lock, gate = threading.Lock(), Gate()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=GatedLease(lock, gate)))
        fut = sp.spill_threadsafe(
            list(range(4)), [fill(C.KVCache(), 4)], attachments=[spilld.Attachment("d", {}, [draft])]
        )
        draft[2:4] = mx.array([100.0, 200.0])  # the engine updates its draft state in place (same object)
        draft += 1
        mx.eval(draft)
        gate.open.set()
        settled: Settled = fut.result(timeout=60)
        lt.run(sp.close())
    finally:
        lt.stop()
    assert settled.stored, settled.error
    assert spilld.load(settled.value.path).attachments[0].tensors[0].tolist() == [float(i) for i in range(8)]


def test_live_snapshot_of_a_cache_left_lazy(tmp_path: Any) -> None:
    def args() -> tuple[tuple[Any, ...], dict[str, Any]]:
        cache = C.KVCache()
        cache.update_and_fetch(*kv(30, seed=4))  # the engine's pending work: not evaluated
        return (list(range(30)), [cache]), {"live": True}

    settled = _spill_from_engine_thread(tmp_path, args)
    assert settled.stored, settled.error
    want = fill(C.KVCache(), 30, seed=4)
    assert equal(freeze(live(spilld.load(settled.value.path).caches[0])), freeze(live(want)))


# --- what a live snapshot cannot read fails, typed, and leaves nothing -------------------------------------------------


def _live_spill_while(tmp_path: Any, engine: Callable[[Any], None]) -> Settled:
    """A live spill of a 30-row cache whose write waits until ``engine(cache)`` has run: how it settled."""
    cache = fill(C.KVCache(), 30)
    lock, gate = threading.Lock(), Gate()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=GatedLease(lock, gate)))
        fut = sp.spill_threadsafe(list(range(30)), [cache], live=True)
        engine(cache)
        gate.open.set()
        settled: Settled = fut.result(timeout=60)
        lt.run(sp.close())
    finally:
        lt.stop()
    return settled


def _regrow(cache: Any) -> None:
    for i in range(15):
        cache.update_and_fetch(*kv(1, seed=300 + i))
    mx.eval(cache.keys, cache.values)


def test_a_cut_grown_back_before_the_write_fails_it(tmp_path: Any) -> None:
    from mlx_lm.models.cache import trim_prompt_cache

    def engine(cache: Any) -> None:
        trim_prompt_cache([cache], 10)  # the engine reuses the cache for another prompt: rows 20.. rewritten
        _regrow(cache)
        assert cache.offset > 30

    settled = _live_spill_while(tmp_path, engine)
    assert settled.outcome is Outcome.FAILED and isinstance(settled.error, spilld.errors.PlanDrift)
    assert not any(f.endswith(".spilld") for _, _, fs in os.walk(tmp_path) for f in fs)


def test_a_shallow_copy_trims_itself_and_its_cuts_count_for_the_original(tmp_path: Any) -> None:
    """Found in review: the watch was installed as the cache's own ``trim``, which ``copy.copy`` copies, so the
    copy's trim cut the original (the copy kept 30 rows, the original 20). The class's ``trim`` counts cuts now. A
    shallow copy shares the original's arrays (mlx-lm writes rows into the same array object), so its cuts count
    for the original too: a live snapshot of the original pending meanwhile fails, never stores the copy's rows."""
    import copy

    cache = fill(C.KVCache(), 30)
    watch = base.CutWatch.of(cache)
    fork = copy.copy(cache)
    fork.trim(10)
    assert (fork.offset, cache.offset) == (20, 30) and watch.cuts == 1
    own = base.CutWatch.of(fork)  # the copy watched on its own (a snapshot of it): still counted for both
    fork.trim(5)
    assert fork.offset == 15 and (own.cuts, watch.cuts) == (1, 2)

    class Sub(C.KVCache):
        def trim(self, n: int) -> int:
            return int(super().trim(n))

    sub = fill(Sub(), 12)
    sub_watch = base.CutWatch.of(sub)
    sub.trim(2)
    assert sub.offset == 10 and sub_watch.cuts == 1  # its trim and its base's: one cut
    plain = fill(C.KVCache(), 8)  # never watched: its class's trim counts nothing, cuts as before
    plain.trim(3)
    assert plain.offset == 5 and getattr(plain, base.CutWatch.ATTR, None) is None

    def engine(cache: Any) -> None:
        fork = copy.copy(cache)
        fork.trim(10)  # the copy reused for another prompt: its rows 20.. are the original's array's too
        _regrow(fork)
        assert cache.offset == 30

    settled = _live_spill_while(tmp_path, engine)
    assert settled.outcome is Outcome.FAILED and isinstance(settled.error, spilld.errors.PlanDrift)


def test_an_engine_that_never_evaluates_fails_the_live_write(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(saver.tensorbytes, "LIVE_LAZY_TIMEOUT_S", 0.3)  # where it is read
    cache = fill(C.KVCache(), 30)
    lock = threading.Lock()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=ThreadLockLease(lock)))
        with lock:
            fut = sp.spill_threadsafe(list(range(30)), [cache], live=True)
            cache.update_and_fetch(*kv(1, seed=1))  # and leaves it lazy: no other thread can evaluate it
        t0 = time.monotonic()
        settled: Settled = fut.result(timeout=60)
        waited = time.monotonic() - t0
        lt.run(sp.close())
    finally:
        lt.stop()
    assert settled.outcome is Outcome.FAILED and isinstance(settled.error, spilld.errors.PlanDrift)
    assert 0.3 <= waited < 30
    assert not any(f.endswith(".spilld") for _, _, fs in os.walk(tmp_path) for f in fs)


@pytest.mark.parametrize("cuts", [base.MAX_CUTS_REMEMBERED, base.MAX_CUTS_REMEMBERED + 1])
def test_cuts_above_the_snapshot_are_fine_until_too_many_to_tell(tmp_path: Any, cuts: int) -> None:
    cache = fill(C.KVCache(), 30)
    lock, gate = threading.Lock(), Gate()
    lt = LoopThread("spiller")
    try:
        sp = lt.run(spilld.Spiller.open(tmp_path, identity=spilld.Identity("m"), lease=GatedLease(lock, gate)))
        want = freeze(live(cache))
        fut = sp.spill_threadsafe(list(range(30)), [cache], live=True)
        for i in range(cuts):  # speculative decoding: a rejected draft token is cut, above the snapshot's rows
            cache.update_and_fetch(*kv(1, seed=400 + i))
            cache.trim(1)
        mx.eval(cache.keys, cache.values)
        gate.open.set()
        settled: Settled = fut.result(timeout=60)
        lt.run(sp.close())
    finally:
        lt.stop()
    if cuts <= base.MAX_CUTS_REMEMBERED:
        assert settled.stored, settled.error
        assert equal(freeze(live(spilld.load(settled.value.path).caches[0])), want)
    else:  # the oldest cut was forgotten: whether it went below the snapshot cannot be told
        assert settled.outcome is Outcome.FAILED and isinstance(settled.error, spilld.errors.PlanDrift)


class _Picklable:
    """A cache-like object that pickles (an mlx array does not): watched as a live spill watches a cache."""

    offset = 30

    def trim(self, n: int) -> int:
        self.offset -= n
        return n


def test_a_watched_cache_is_freed_when_dropped_and_its_deep_copy_watches_itself() -> None:
    """Found in review: a live snapshot installs a watch as the cache's ``trim``, and the watch held the cache: a
    cycle, so an engine's dropped cache kept its buffers until a full collection (never, under ``gc.freeze``)."""
    import copy
    import gc
    import weakref

    cache = fill(C.KVCache(), 30)
    watch = base.CutWatch.of(cache)
    twin = copy.deepcopy(cache)  # the copy's trim cuts the copy and counts there, not in the original
    twin.trim(5)
    assert (twin.offset, cache.offset) == (25, 30) and base.CutWatch.of(twin).cuts == 1 and watch.cuts == 0
    cache.trim(2)
    assert cache.offset == 28 and watch.cuts == 1
    import pickle

    watched = _Picklable()
    base.CutWatch.of(watched)
    restored = pickle.loads(pickle.dumps(watched))  # found in review: a watched cache no longer pickled
    restored.trim(4)
    assert restored.offset == 26 and base.CutWatch.of(restored).cuts == 1 and base.CutWatch.of(watched).cuts == 0
    gone = weakref.ref(cache)
    gc.disable()
    try:
        del cache, watch
        assert gone() is None  # freed by its count, no collection needed
    finally:
        gc.enable()
