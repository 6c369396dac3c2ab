"""A client's spills against a daemon that is slow or busy copying: what is stored is the bytes of the call, and
a barrier comes after the spills sent before it (both found in review).

A live spill sent inline (no shared memory) copies each tensor's rows into one reused staging buffer; the transport
may keep the views it is given past ``drain`` (uvloop does below its high-water mark, as does Python 3.12's loop),
so before the fix the next tensor's rows overwrote bytes still waiting to be sent: 4-8 of 80 tensors held their
neighbour's bytes, hashed by the daemon as received and reported stored."""

from __future__ import annotations

import os
import signal
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld.client import AsyncClient
from spilld.lease import ThreadLockLease
from tests.daemons import Daemon, cleanup, new_root

LAYERS, ROWS = 40, 128


def caches(seed: int) -> list[C.KVCache]:
    out = []
    for layer in range(LAYERS):
        mx.random.seed(seed * 1000 + layer)
        c = C.KVCache()
        shape = (1, 2, ROWS, 64)
        c.update_and_fetch(mx.random.normal(shape).astype(mx.float16), mx.random.normal(shape).astype(mx.float16))
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def arrays(cs: list[C.KVCache]) -> list[np.ndarray]:
    return [np.array(x[..., :ROWS, :]) for c in cs for x in (c.keys, c.values)]


def throttle(pid: int, stop: threading.Event) -> None:
    """A busy daemon: it runs 1 ms in 10, so the client's socket fills and its transport keeps bytes."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.009)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.001)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.asyncio
async def test_a_live_inline_spill_to_a_slow_daemon_stores_the_bytes_of_the_call() -> None:
    d = Daemon(new_root(), ["--cap", "1GiB"]).start()
    try:
        lease = ThreadLockLease(threading.Lock())
        async with AsyncClient(d.socket, identity=spilld.Identity("live-inline"), shm=False, lease=lease) as cl:
            for r in range(2):
                cs = caches(r)
                want = arrays(cs)
                stop = threading.Event()
                assert d.proc is not None
                th = threading.Thread(target=throttle, args=(d.proc.pid, stop))
                th.start()
                try:
                    s = await cl.spill(list(range(r * 1000, r * 1000 + ROWS)), cs, live=True, droppable=False)
                finally:
                    stop.set()
                    th.join()
                assert s.stored
                got = arrays(spilld.load(s.value.path).caches)
                wrong = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not np.array_equal(a, b)]
                assert wrong == [], f"round {r}: tensors {wrong} differ from the call's"
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_a_barrier_after_a_spill_over_shared_memory_settles_after_it() -> None:
    """A commit waits for its shared-memory copies before its item is queued; a barrier sent after it must still be
    queued after it (found in review: it overtook the spill, so `delete_checkpoints` deleted nothing and left the
    checkpoint just spilled on disk)."""
    from spilld import format as fmt

    d = Daemon(new_root(), ["--cap", "1GiB"]).start()
    try:
        async with AsyncClient(d.socket, identity=spilld.Identity("barrier")) as cl:
            for r in range(3):
                c = C.KVCache()
                mx.random.seed(r)
                k = mx.random.normal((1, 8, 8192, 128)).astype(mx.float16)  # 16 MiB a tensor: copies take a while
                c.update_and_fetch(k, k + 1)
                mx.eval(c.keys, c.values)
                key = f"gen{r}"
                ck = fmt.GenerationCheckpoint(
                    key=key, cache_ns="", original_prompt_tokens=8191, generated_tokens=1, pending_token=None,
                    seed=0, seed_was_explicit=False,
                )  # fmt: skip
                fut = cl.spill(list(range(8192)), [c], checkpoint=ck, droppable=False)
                b = await cl.barrier(key)
                assert fut.done(), f"round {r}: the barrier settled before the spill sent ahead of it"
                assert (await fut).stored and b.stored
                assert (await cl.finish(key)).value == 1  # the checkpoint it stored, deleted
    finally:
        d.kill()
        cleanup(d.root)
