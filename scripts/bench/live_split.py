"""The engine thread's share of a live spill, with the plan made by the writer (now: the call only records offsets
and evaluates buffers) or on the calling thread too, side by side in one process: ``snapshot.new_item`` alone, arms
interleaved.

    python scripts/bench/live_split.py [--layers 32 --tokens 8191 --calls 30 --runs 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from spill_call import big_cache  # this folder is the script's first import path

import spilld
from spilld.codecs import default_provider
from spilld.snapshot import new_item, planned


def cpu_ms(fn: Callable[[], Any]) -> float:
    t = time.thread_time()
    fn()
    return (time.thread_time() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8191)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a second")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.tokens, args.calls, args.runs = 2, 64, 3, 1
    caches = big_cache(args.layers, args.tokens, heads=8, dim=128)
    provider, ident, tokens = default_provider(), spilld.Identity("bench"), list(range(args.tokens))
    arms: dict[str, Callable[[], Any]] = {
        "clone": lambda: new_item(ident, provider, tokens, caches),
        "live, planned by the writer": lambda: new_item(ident, provider, tokens, caches, live=True),
        "live, planned on this thread too": lambda: planned(new_item(ident, provider, tokens, caches, live=True)),
    }
    for run in range(args.runs):
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.calls):
            for name, fn in arms.items():
                times[name].append(cpu_ms(fn))
        print(f"run {run}: " + ", ".join(f"{n} {statistics.median(t):.3f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
