"""Decode latency with idle and spilling windows interleaved in one engine run (ABAB), per-pair ratios.

``decode_interference.py`` runs each arm on its own, so its idle baseline moves between arms as much as the effect
it measures. Here one engine thread decodes continuously (a tiny random-weight llama plus a large synthetic KV cache
extended by one row a step, under its generation lock) and alternates windows:

  spill window  starts when a spill is handed to an embedded ``Spiller`` (``ThreadLockLease`` on the generation lock,
                durability fsync) and lasts until that spill is durable, and at least ``--window`` tokens;
  idle window   the next ``--window`` tokens, nothing in flight.

Each (spill, idle) pair gives a ratio p99(spill window) / p99(idle window); the figures are their median and spread
over ``--pairs`` pairs (>= 5), per case: eviction (caches the engine drops) and snapshot (its own live cache, live=True).
The spill's speed is its bytes over hand-over-to-durable time, while decode runs.

    python scripts/bench/decode_abab.py [--pairs 8 --window 60] [--model-dtype bfloat16] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from decode_interference import add_engine_args, big_cache, build_model, decode_step, nbytes

import spilld
from spilld import mlxthreads
from spilld.daemon.listen import is_served

MiB = 1024 * 1024


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


class _Stored:
    stored = True


class DmaCopier:
    """Copies mlx arrays in CUDA managed memory to pinned host memory with the GPU's copy engine, on a
    non-blocking stream of its own (ctypes releases the GIL for each CUDA call)."""

    CHUNK = 8 * MiB
    _D2H_DEFAULT = 4  # cudaMemcpyDefault: the driver tells managed from device memory

    def __init__(self) -> None:
        from gpu_reads import cudart

        rt = cudart()
        if rt is None:
            raise RuntimeError("the dma arms need mlx's CUDA runtime (mlx-cuda, the GPU as default device)")
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.rt, self.stream = rt, ctypes.c_void_p()
        if rt.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1) != 0:  # cudaStreamNonBlocking
            raise RuntimeError("cudaStreamCreateWithFlags failed")
        self.bufs: list[ctypes.c_void_p] = []
        for _ in range(2):
            p = ctypes.c_void_p()
            if rt.cudaMallocHost(ctypes.byref(p), ctypes.c_size_t(self.CHUNK)) != 0:
                raise RuntimeError("cudaMallocHost failed")
            self.bufs.append(p)

    def _copy(self, dst: ctypes.c_void_p, src: int, n: int) -> None:
        if self.rt.cudaMemcpyAsync(dst, ctypes.c_void_p(src), n, self._D2H_DEFAULT, self.stream) != 0:
            raise RuntimeError("cudaMemcpyAsync failed")

    def _sync(self) -> None:
        if self.rt.cudaStreamSynchronize(self.stream) != 0:
            raise RuntimeError("cudaStreamSynchronize failed")

    def chunks(self, arrays: list[Any]) -> Any:
        """Yields each array's bytes, in order, as memoryviews of pinned memory valid until the next one."""
        from gpu_reads import address

        runs = []
        for a in arrays:
            p, n = address(a)
            runs += [(p + lo, min(self.CHUNK, n - lo)) for lo in range(0, n, self.CHUNK)]
        if not runs:
            return
        self._copy(self.bufs[0], *runs[0])
        for k, (_, n) in enumerate(runs):
            self._sync()  # chunk k has landed
            if k + 1 < len(runs):
                self._copy(self.bufs[(k + 1) % 2], *runs[k + 1])
            yield memoryview((ctypes.c_char * n).from_address(self.bufs[k % 2].value or 0)).cast("B")


class Sink:
    """Where a spill window's work goes (``--via``): an embedded ``Spiller`` (``ThreadLockLease`` on the engine's
    lock), a spilld daemon in another process (``spilld.Client`` with the same lease), or ``python``: no spill, a
    thread that runs pure Python for the window (it holds the GIL as a spill's Python would, and touches neither
    the GPU's memory nor the disk)."""

    def __init__(self, args: argparse.Namespace, lock: Any, folder: str) -> None:
        self.via = args.via
        self.pace = args.pace
        self.bare_path = os.path.join(folder, "bare.bin")
        self.daemon: subprocess.Popen[bytes] | None = None
        self.busy_stop = threading.Event()  # ends the python arm's busy thread
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dma = DmaCopier() if self.via.startswith("dma") else None  # fails here, not in the spill's thread
        lease = spilld.ThreadLockLease(lock)
        ident = spilld.Identity("abab")
        if self.via == "spiller":
            self.loop = asyncio.new_event_loop()
            self.thread = mlxthreads.start_thread(self.loop.run_forever, "spill-loop", daemon=True)
            open_ = spilld.Spiller.open(folder, identity=ident, lease=lease, queue_cap=8 << 30)
            self.spiller = asyncio.run_coroutine_threadsafe(open_, self.loop).result()
        elif self.via == "daemon":
            sock = os.path.join(folder, "s.sock")
            cmd = [sys.executable, "-m", "spilld", "--dir", os.path.join(folder, "store"), "--socket", sock]
            self.daemon = subprocess.Popen(
                [*cmd, "--cap", "16GiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + 60
            while not is_served(sock):  # accepting, not only bound (a refused connect raced the listen)
                if self.daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the daemon did not start")
                time.sleep(0.05)
            self.client = spilld.Client(sock, identity=ident, lease=lease, queue_cap=8 << 30)

    def spill(self, tokens: list[int], caches: list[Any], live: bool) -> Any:
        if self.via == "spiller":
            return self.spiller.spill_threadsafe(tokens, caches, live=live)
        if self.via == "daemon":
            return self.client.spill(tokens, caches, live=live, droppable=False)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.via in ("hash", "write", "dma", "dma-hash", "dma-write"):
            arrays = [a for c in caches for a in (c.keys, c.values)]
            work = self._dma if self.via.startswith("dma") else self._bare
            mlxthreads.start_thread(lambda: work(arrays, fut), "bare", daemon=True)
            return fut
        if self.via == "python":
            self.busy_stop.clear()
            threading.Thread(target=self._busy, daemon=True).start()  # pure Python: no mlx streams to free
        return fut  # (nothing: the window is idle too, an A/A control of the ratio's own spread)

    def _busy(self) -> None:
        x = 0
        while not self.busy_stop.is_set():
            for i in range(1000):
                x += i

    def _bare(self, arrays: list[Any], fut: Any) -> None:
        """The bytes of ``arrays`` hashed (xxh3) or written (``pwrite``, one fsync at the end) in 8 MiB chunks by
        this thread alone: a spill's data work with none of spilld's machinery (no loop, no lease, no steps)."""
        from spilld import dtypes

        def chunks() -> Any:
            for a in arrays:
                mv = dtypes.buffer(a).cast("B")
                for lo in range(0, mv.nbytes, 8 * MiB):
                    yield mv[lo : lo + 8 * MiB]

        self._consume(chunks(), fut, hashed=self.via == "hash", written=self.via == "write")

    def _dma(self, arrays: list[Any], fut: Any) -> None:
        """Copy-out by the GPU's copy engine: each array's bytes moved with ``cudaMemcpyAsync`` on a CUDA stream of
        this thread's own into pinned host memory (two 8 MiB buffers in turn: chunk k+1 is copied while chunk k is
        worked on), so no CPU thread reads the engine's managed memory and no page migrates. ``dma`` stops there;
        ``dma-hash`` hashes each chunk from the pinned buffer; ``dma-write`` hashes and writes it (one fsync)."""
        assert self.dma is not None
        chunks = self.dma.chunks(arrays)
        self._consume(chunks, fut, hashed=self.via != "dma", written=self.via == "dma-write")

    def _consume(self, chunks: Any, fut: Any, hashed: bool, written: bool) -> None:
        """Each chunk hashed and/or written (one fsync at the end), at ``--pace`` at most; ``fut`` then settles."""
        import xxhash

        fd = -1
        if written:
            os.makedirs(os.path.dirname(self.bare_path), exist_ok=True)
            fd = os.open(self.bare_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            h, done = xxhash.xxh3_64(), 0
            t0 = time.perf_counter()
            for chunk in chunks:
                if hashed:
                    h.update(chunk)
                if fd >= 0:
                    os.pwrite(fd, chunk, done)
                done += chunk.nbytes
                self._pace(t0, done)
            if fd >= 0:
                os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        fut.set_result(_Stored())

    def _pace(self, t0: float, done: int) -> None:
        """With ``--pace``: sleep until ``done`` bytes since ``t0`` are no faster than the pace."""
        if self.pace > 0:
            ahead = done / (self.pace * 1e9) - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def window_ended(self, fut: Any) -> None:
        """The spill window has its tokens: the python arm's work ends with them (a spill ends when it is durable)."""
        if self.via in ("python", "nothing") and not fut.done():
            self.busy_stop.set()
            fut.set_result(_Stored())

    def close(self) -> None:
        if self.via == "spiller" and self.loop is not None:
            asyncio.run_coroutine_threadsafe(self.spiller.close(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
        elif self.via == "daemon" and self.daemon is not None:
            self.client.close()
            self.daemon.terminate()
            self.daemon.wait(timeout=120)


def run_case(case: str, args: argparse.Namespace, model: Any, folder: str) -> dict[str, Any]:
    lock: Any = spilld.FairLock() if args.lock == "fair" else threading.Lock()
    sink = Sink(args, lock, folder)
    own = C.make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, args.context + 1))]), cache=own))
    live_big = big_cache(args.big_layers, args.big_tokens, args.heads, args.dim, seed=1)
    evict = [big_cache(args.big_layers, args.big_tokens, args.heads, args.dim, seed=10 + i) for i in range(args.pairs)]
    tok = mx.array([[5]])
    row = mx.zeros((1, args.heads, 1, args.dim), dtype=mx.float16)
    pairs: list[dict[str, Any]] = []
    spill_lat: list[float] = []
    idle_lat: list[float] = []
    state = "warmup"
    left = args.warmup
    pending: Any = None
    handed = 0.0
    settled = [0.0]  # when the spill in flight was durable
    current: dict[str, Any] = {}
    spilled = 0
    last = time.perf_counter()
    began = time.monotonic()
    while len(pairs) < args.pairs:
        if time.monotonic() - began > args.max_seconds:
            print(f"{case}: {len(pairs)} pairs in {args.max_seconds:g} s: the spill is starved", flush=True)
            break
        decode_step(lock, model, tok, own, live_big, row)
        now = time.perf_counter()
        dt, last = (now - last) * 1e3, now
        if state == "spill":
            spill_lat.append(dt)
            left -= 1
            if left <= 0:
                sink.window_ended(pending)
            if left <= 0 and pending.done():
                outcome = pending.result()
                if not outcome.stored:
                    raise RuntimeError(f"a spill was not stored: {outcome}")
                durable_s = settled[0] - handed
                state, left, pending = "idle", args.window, None
                current = {"spill_tokens": len(spill_lat), "spill_GBps": spilled / durable_s / 1e9}
        elif state == "idle":
            idle_lat.append(dt)
            left -= 1
            if left <= 0:
                current |= {"ratio": p99(spill_lat) / p99(idle_lat), "p99_spill_ms": p99(spill_lat)}
                current |= {"p99_idle_ms": p99(idle_lat), "p50_spill_ms": statistics.median(spill_lat)}
                current |= {"p50_idle_ms": statistics.median(idle_lat)}
                pairs.append(current)
                spill_lat, idle_lat, state = [], [], "warmup"
                left = 1
        else:
            left -= 1
        if state == "warmup" and left <= 0:
            caches = live_big if case == "snapshot" else evict[len(pairs)]
            spilled = nbytes(caches)
            handed = time.perf_counter()
            pending = sink.spill(list(range(caches[0].offset)), caches, live=case == "snapshot")
            pending.add_done_callback(lambda _f: settled.__setitem__(0, time.perf_counter()))
            if case == "eviction":
                evict[len(pairs)] = []  # the engine drops them
            del caches
            state, left = "spill", args.window
    sink.close()
    if pending is not None:
        pending.result(timeout=600)  # decode stopped: the starved spill gets the lock now
    ratios = [p["ratio"] for p in pairs] or [float("nan")]
    speeds = [p["spill_GBps"] for p in pairs] or [float("nan")]
    return {
        "case": case,
        "pairs": pairs,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "spill_GBps_median": statistics.median(speeds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=8, help="(spill, idle) window pairs per case (default 8)")
    p.add_argument("--window", type=int, default=60, help="tokens per window at least (default 60)")
    p.add_argument("--warmup", type=int, default=10)
    add_engine_args(p)
    p.add_argument("--cases", default="eviction,snapshot")
    p.add_argument(
        "--lock",
        choices=["fair", "plain"],
        default="fair",
        help="the engine's generation lock: spilld.FairLock (default) or threading.Lock, which a fast decode loop "
        "takes back at once: the spill then waits for decode to pause",
    )
    p.add_argument(
        "--via",
        choices=["spiller", "daemon", "python", "nothing", "hash", "write", "dma", "dma-hash", "dma-write"],
        default="spiller",
        help="where a spill window's work goes: an embedded Spiller (default), a spilld daemon in another process, "
        "python: no spill, a thread running pure Python for the window (the GIL alone); hash or write: a thread "
        "hashing or writing the caches' bytes in 8 MiB chunks, none of spilld's machinery; dma, dma-hash, dma-write: "
        "the same after copying them to pinned host memory with cudaMemcpyAsync on a stream of their own (CUDA only); "
        "nothing: a spill window in which nothing runs (what the ratio reads between two idle windows)",
    )
    p.add_argument("--pace", type=float, default=0.0, help="GB/s at most for the hash, write and dma arms (0: unpaced)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="give up a case after this long (a starved spill)")
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny model and caches, 2 pairs of 8 tokens")
    args = p.parse_args()
    if args.smoke:
        args.pairs, args.window, args.warmup, args.big_layers, args.big_tokens = 2, 8, 2, 2, 256
        args.hidden, args.layers, args.vocab = 64, 2, 512
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    folder = args.dir or tempfile.mkdtemp(prefix="spilld-abab-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    model = build_model(args)
    out: dict[str, Any] = {"device": str(mx.default_device()), "args": vars(args), "cases": []}
    try:
        for case in args.cases.split(","):
            r = run_case(case, args, model, folder)
            out["cases"].append(r)
            ratios = ", ".join(f"{x['ratio']:.2f}" for x in r["pairs"])
            print(
                f"{case:9s} p99 spill/idle per pair: {ratios}; median "
                f"{r['ratio_median']:.3f} (min {r['ratio_min']:.2f}, max {r['ratio_max']:.2f}); spill "
                f"{r['spill_GBps_median']:.2f} GB/s while decoding",
                flush=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.via.startswith("dma"):
        sys.stdout.flush()
        os._exit(0)  # skip teardown: a CUDA stream made through ctypes can crash mlx's exit handlers


if __name__ == "__main__":
    main()
