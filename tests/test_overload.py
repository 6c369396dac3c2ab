"""Overload soak: producers offer the daemon more than its disk can write, for 20 s (60 s with SPILLD_LONG=1).

The daemon runs as a subprocess with a small ``--cap`` and durability ``fsync``; several producer connections
(``AsyncClient``, shared-memory and inline ingest) spill real mlx-lm ``KVCache`` items of 2-6 MiB as fast as the
daemon takes them, mostly droppable, some not, with barriers in between. Every ~100 ms a sampler thread reads the
daemon's ``status`` (queued bytes) and ``/proc/PID/status`` (RSS). Checked: queued bytes never exceed cap + the
largest item; RSS grows by at most cap + largest item + 64 MiB over the idle daemon's; every barrier is stored;
every item's owner hears its outcome and the outcomes add up to the daemon's counters; ``spilld drain`` exits 0;
stored entries are on disk whole and a sample of them loads back exactly.

Alongside, clients that try to make the daemon hold memory (``tests/hostile_memory.py``): a giant declared spill
(refused ``busy`` at once, every time), a slow-loris spill (aborted after the idle timeout, again and again) and
spills whose headers hold 125,000 tokens each (counted against the cap while open). The RSS bound then
counts the largest thing the daemon admitted (such a header's parsed form) as the largest item.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop
from mlx_lm.models import cache as C

import spilld
from spilld import protocol as P
from spilld.client import AsyncClient, Client
from spilld.daemon.ingest import PARSED_BYTES_PER_TOKEN
from spilld.shm import POOL_SEGMENTS, SEGMENT_BYTES
from tests.caches import fill, live, same
from tests.conftest import LONG
from tests.daemons import Daemon, cleanup, new_root
from tests.hostile_memory import HUGE_HEADER_TOKENS, run_all

MiB = 1024 * 1024
CAP = 64 * MiB
SECONDS = 60.0 if LONG else 20.0
PRODUCERS = 4
WINDOW = 12  # a producer's items not yet answered: enough to keep its client's pipeline full
NON_DROPPABLE_EVERY = 20  # one item in twenty must not be dropped
BARRIER_PERIOD_S = 1.0  # each producer asks for a barrier this often
SAMPLE_PERIOD_S = 0.1
RSS_SLACK = 64 * MiB
SIZES = (256, 512, 768)  # tokens: f32 K and V of 8 heads x 128 = 2, 4 and 6 MiB per item
VARIANTS_PER_SIZE = 2
IDENT = spilld.Identity("overload")
IDLE_TIMEOUT_S = 6.0  # also how long a silent open spill is kept (short: a slow-loris spill expires in the run)


@dataclass
class Variant:
    tokens: int
    seed: int
    cache: Any
    nbytes: int


@dataclass(eq=False)
class Offer:
    producer: int
    seq: int
    variant: Variant
    droppable: bool
    tokens: list[int]
    future: Any = None
    result: spilld.Settled | None = None


@dataclass
class Sample:
    t: float
    pending_bytes: int
    peak_bytes: int
    bytes_written: int
    vm_rss: int
    rss_anon: int
    rss_shmem: int


@dataclass
class Run:
    offers: list[Offer] = field(default_factory=list)
    barriers: list[spilld.Settled] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    load_s: float = 0.0
    written_at_start: int = 0
    written_at_stop: int = 0
    hostile: Counter[str] = field(default_factory=Counter)


def variants() -> list[Variant]:
    out = []
    for n in SIZES:
        for k in range(VARIANTS_PER_SIZE):
            seed = n * 10 + k
            cache = fill(C.KVCache(), n, heads=8, dim=128, seed=seed)
            out.append(Variant(n, seed, cache, cache.keys.nbytes + cache.values.nbytes))
    return out


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssShmem... of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.startswith(("VmRSS", "Rss")):
                out[name] = int(rest.split()[0]) * 1024
    return out


def sampler(d: Daemon, run: Run, stop: threading.Event) -> None:
    """Every SAMPLE_PERIOD_S: the daemon's queue (through ``status``) and its memory (through /proc)."""
    assert d.proc is not None
    client = Client(d.socket, identity=IDENT, name="sampler")
    try:
        t0 = time.monotonic()
        while not stop.is_set():
            q = client.status()["queue"]
            m = proc_status(d.proc.pid)
            run.samples.append(
                Sample(
                    time.monotonic() - t0,
                    q["pending_bytes"],
                    q["peak_bytes"],
                    q["bytes_written"],
                    m["VmRSS"],
                    m["RssAnon"],
                    m["RssShmem"],
                )
            )
            stop.wait(SAMPLE_PERIOD_S)
    finally:
        client.close()


async def produce(d: Daemon, run: Run, vs: list[Variant], seconds: float) -> None:
    loop = asyncio.get_running_loop()
    status = await AsyncClient.open(d.socket, identity=IDENT, name="counter")
    run.written_at_start = (await status.status())["queue"]["bytes_written"]
    t0 = loop.time()
    stop = t0 + seconds

    async def producer(p: int) -> None:
        # half the producers ship through shared memory, half inline; the client never drops (its cap is large)
        client = await AsyncClient.open(d.socket, identity=IDENT, name=f"producer {p}", shm=p % 2 == 0)
        unanswered: set[Any] = set()
        barriers: list[asyncio.Future[spilld.Settled]] = []
        next_barrier = t0 + BARRIER_PERIOD_S * (1 + p / PRODUCERS)
        seq = 0
        while loop.time() < stop:
            while len(unanswered) >= WINDOW:
                _, unanswered = await asyncio.wait(unanswered, return_when=asyncio.FIRST_COMPLETED)
            v = vs[(p + seq) % len(vs)]
            o = Offer(p, seq, v, seq % NON_DROPPABLE_EVERY != NON_DROPPABLE_EVERY - 1, [])
            o.tokens = [1_000_000 + p * 100_000 + seq, *range(v.tokens - 1)]  # its own prompt: no shared prefix
            o.future = client.spill(o.tokens, [v.cache], droppable=o.droppable)
            unanswered.add(o.future)
            run.offers.append(o)
            seq += 1
            if loop.time() >= next_barrier:
                barriers.append(client.barrier(f"p{p}-{len(barriers)}"))
                next_barrier += BARRIER_PERIOD_S
            await asyncio.sleep(0)
        run.barriers += await asyncio.gather(*barriers)
        await client.close()

    hostile_stop = asyncio.Event()
    hostile = loop.create_task(run_all(d.socket, run.hostile, IDLE_TIMEOUT_S, hostile_stop))
    await asyncio.gather(*(producer(p) for p in range(PRODUCERS)))
    hostile_stop.set()
    await hostile
    run.load_s = loop.time() - t0
    with contextlib.suppress(P.ConnectionLost):  # idle through the run: the daemon may have cut it
        await status.status()
    run.written_at_stop = (await status.status())["queue"]["bytes_written"]
    for o in run.offers:
        o.result = await o.future
    await status.close()


async def verify(d: Daemon, sample: list[Offer]) -> None:
    client = await AsyncClient.open(d.socket, identity=IDENT, name="verifier")
    for o in sample:
        loaded = await client.load([*o.tokens, 7])
        assert loaded is not None, f"stored item {o.producer}/{o.seq} is not found"
        assert len(loaded.tokens) == len(o.tokens)
        assert same(live(loaded.caches[0]), live(o.variant.cache)), f"item {o.producer}/{o.seq} differs"
    await client.close()


def soak(seconds: float) -> dict[str, Any]:
    """Run the soak, check it, and return its figures."""
    vs = variants()
    largest = max(v.nbytes for v in vs)
    args = ["--cap", str(CAP), "--durability", "fsync", "--disk-cap", "60GiB", "--idle-timeout", str(IDLE_TIMEOUT_S)]
    d = Daemon(new_root(), args).start()
    run = Run()
    try:
        assert d.proc is not None
        time.sleep(1.0)
        Client(d.socket, identity=IDENT, name="warm-up").close()
        time.sleep(0.5)
        idle_rss = proc_status(d.proc.pid)
        done = threading.Event()
        th = threading.Thread(target=sampler, args=(d, run, done), daemon=True)
        th.start()
        try:
            uvloop.run(produce(d, run, vs, seconds))
        finally:
            done.set()
            th.join(30)
        r = d.cli("drain", "--socket", d.socket, "--timeout", "120")
        assert r.returncode == 0, r.stdout + r.stderr

        # every owner was told; the outcomes add up to the daemon's counters
        stored = [o for o in run.offers if o.result is not None and o.result.stored]
        dropped = [o for o in run.offers if o.result is not None and o.result.outcome is spilld.Outcome.DROPPED]
        refused = [o for o in run.offers if o.result is not None and isinstance(o.result.error, P.Busy)]
        odd = [(o.producer, o.seq, o.droppable, o.result) for o in run.offers if o not in {*stored, *dropped, *refused}]
        assert not odd, odd[:5]
        assert all(o.droppable for o in dropped), "a non-droppable item was dropped"
        # A non-droppable item's room is held from its `spill`, so it is never refused `busy` at its commit
        # (a `busy` at `spill` is retried by the client and never reaches the owner).
        assert not refused, refused[:5]
        assert [b.outcome for b in run.barriers] == [spilld.Outcome.STORED] * len(run.barriers)
        assert len(run.barriers) >= PRODUCERS * int(seconds / BARRIER_PERIOD_S - 2)
        st = json.loads(d.cli("status", "--socket", d.socket, "--json").stdout)
        q, store = st["queue"], st["store"]
        assert q["stored"] == len(stored) and q["barriers"] == len(run.barriers)
        assert q["dropped"] == len(dropped)
        assert (q["failed"], q["cancelled"], q["pending_items"], q["pending_bytes"]) == (0, 0, 0, 0)

        # stored means on disk, whole: every path is there with its size; a sample loads back exactly
        assert store["entries"] == len(stored) and store["evicted"] == 0 and store["quarantined"] == 0
        for o in stored:
            assert o.result is not None
            assert os.path.getsize(o.result.value.path) == o.result.value.file_bytes
        rng = random.Random(6)
        sample = [rng.choice([o for o in stored if o.producer == p]) for p in range(PRODUCERS)]
        sample += rng.sample([o for o in stored if not o.droppable], 4)
        sample += rng.sample(stored, 6)
        uvloop.run(verify(d, sample))

        # memory: the queue within cap + the largest item at every sample, RSS within the bound
        assert len(run.samples) >= seconds / SAMPLE_PERIOD_S / 3
        max_queued = max(s.pending_bytes for s in run.samples)
        assert max_queued <= CAP + largest
        assert q["peak_bytes"] <= CAP + largest  # the daemon's own peak, between samples too
        # VmRSS also counts the producers' shared-memory segments the daemon has mapped (RssShmem): the clients'
        # pools, shared with them, at most POOL_SEGMENTS x SEGMENT_BYTES each; the bound is on the daemon's own.
        growth = max(s.vm_rss for s in run.samples) - idle_rss["VmRSS"]
        private_growth = max(s.vm_rss - s.rss_shmem for s in run.samples) - idle_rss["VmRSS"] + idle_rss["RssShmem"]
        max_shmem = max(s.rss_shmem for s in run.samples)
        largest_admitted = max(largest, HUGE_HEADER_TOKENS * PARSED_BYTES_PER_TOKEN)  # a hostile header, parsed
        assert private_growth <= CAP + largest_admitted + RSS_SLACK
        h = run.hostile
        assert h["giant_refused"] > 0 and h["giant_admitted"] == 0, h
        assert h["loris_expired"] >= 1 and h["loris_not_expired"] == 0, h
        assert h["header_opened"] > 0, h
        assert max_shmem <= len(range(0, PRODUCERS, 2)) * POOL_SEGMENTS * SEGMENT_BYTES

        offered = sum(o.variant.nbytes for o in run.offers)
        stored_bytes = sum(o.variant.nbytes for o in stored)
        disk_rate = (run.written_at_stop - run.written_at_start) / run.load_s
        figures = {
            "seconds": round(run.load_s, 1),
            "producers": PRODUCERS,
            "cap_MiB": CAP / MiB,
            "largest_item_MiB": largest / MiB,
            "items_offered": len(run.offers),
            "items_stored": len(stored),
            "items_dropped": len(dropped),
            "non_droppable": sum(not o.droppable for o in run.offers),
            "non_droppable_refused_busy": len(refused),
            "barriers": len(run.barriers),
            "offered_GBps": round(offered / run.load_s / 1e9, 3),
            "stored_GBps": round(disk_rate / 1e9, 3),
            "offered_over_stored": round(offered / run.load_s / disk_rate, 2),
            "offered_over_stored_bytes": round(offered / stored_bytes, 2),
            "max_queued_MiB": round(max_queued / MiB, 1),
            "daemon_peak_queued_MiB": round(q["peak_bytes"] / MiB, 1),
            "idle_rss_MiB": round(idle_rss["VmRSS"] / MiB, 1),
            "max_rss_growth_MiB": round(growth / MiB, 1),
            "max_private_rss_growth_MiB": round(private_growth / MiB, 1),
            "max_rss_shmem_MiB": round(max_shmem / MiB, 1),
            "rss_bound_MiB": round((CAP + largest_admitted + RSS_SLACK) / MiB, 1),
            "hostile": dict(sorted(h.items())),
            "samples": len(run.samples),
            "max_sample_gap_s": round(max(b.t - a.t for a, b in zip(run.samples, run.samples[1:], strict=False)), 2),
        }
        print("overload soak:", json.dumps(figures))
        assert dropped, "the daemon never had to shed: the producers did not outrun the disk"
        return figures
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/PID/status")
def test_overload_soak_keeps_memory_bounded_and_every_owner_told() -> None:
    figures = soak(SECONDS)
    assert figures["offered_over_stored"] >= 1.5
