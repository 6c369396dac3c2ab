"""Time the engine thread spends inside ``spill()`` for a 1 GiB cache (the budget is 1 ms).

A ``Spiller`` runs on a loop thread with a ``ThreadLockLease``; this thread is the engine: it holds the lock,
calls ``spill()`` and times the call (everything ``spill()`` evaluates or copies on the engine's thread is in it),
as wall time and as this thread's CPU time (the latter is what a busy, shared machine cannot inflate).
Arms: plain (clones), tokens as an mlx array plus an attachment, ``live=True``. Writes are drained between calls,
outside the timing.

    python scripts/bench/spill_call.py [--layers 32 --tokens 8191 --calls 20] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

import spilld
from spilld.loopthread import LoopThread


def big_cache(layers: int, tokens: int, heads: int, dim: int) -> list[Any]:
    out = []
    for _ in range(layers):
        c = C.KVCache()
        c.update_and_fetch(*(mx.random.normal((1, heads, tokens, dim)).astype(mx.float16) for _ in range(2)))
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def time_calls(
    args: argparse.Namespace, arm: str, caches: list[Any], sp: Any, lt: LoopThread, lock: Any
) -> tuple[list[float], list[float]]:
    n = caches[0].offset
    times, cpu = [], []
    for i in range(args.calls):
        tokens: Any = list(range(n))
        kw: dict[str, Any] = {}
        if arm == "mlx_tokens_attachment":
            tokens = mx.arange(n)
            kw["attachments"] = [spilld.Attachment("draft", {}, [mx.arange(4096, dtype=mx.float32) + i])]
        elif arm == "live":
            kw["live"] = True
        with lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            fut = sp.spill_threadsafe(tokens, caches, key=f"{arm}{i}", **kw)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        assert fut.result(timeout=600).stored
        lt.run(sp.drain())
    return times, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8191)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.tokens, args.calls = 2, 64, 2
    caches = big_cache(args.layers, args.tokens, args.heads, args.dim)
    gib = sum(c.keys.nbytes + c.values.nbytes for c in caches) / 2**30
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
        lt = LoopThread("spiller")
        try:
            lease = spilld.ThreadLockLease(lock)
            sp = lt.run(spilld.Spiller.open(folder, identity=spilld.Identity("bench"), lease=lease, queue_cap=4 << 30))
            print(f"cache: {args.layers} x 2 x (1, {args.heads}, {args.tokens}, {args.dim}) f16 = {gib:.3f} GiB")
            for arm in ("clone", "mlx_tokens_attachment", "live"):
                wall, cpu = ([x * 1e3 for x in xs] for xs in time_calls(args, arm, caches, sp, lt, lock))
                print(
                    f"{arm:>22}: spill() wall median {statistics.median(wall):.3f} ms, max {max(wall):.3f} ms;"
                    f" engine-thread CPU median {statistics.median(cpu):.3f} ms, max {max(cpu):.3f} ms ({len(wall)} calls)"
                )
            lt.run(sp.close())
        finally:
            lt.stop()


if __name__ == "__main__":
    main()
