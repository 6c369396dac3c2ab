"""Format v2 against v1: restore from blocks vs one file of the same bytes, and lookup against many manifests.

restore: one cache (default 32 layers of ``KVCache``, K and V float16 ``(1, 8, 8192, 128)``, 1 GiB) is put into a
  store with whole files (``block_tokens=0``, a v1-style single file) and into one with blocks (B = 256: 32 block
  files + a manifest); both restore the same prefix (``Store.restore_async``, hashes verified), arms alternating
  run by run, each cold (``echo 3 > /proc/sys/vm/drop_caches`` before it, when permitted) then at once warm,
  ``--warm-repeats`` times (a run's warm figure is their median). The ratio is blocks / one file, per run, and its
  median.
lookup: a store with N conversations (distinct prompts of ``--conv-tokens`` tokens sharing their first 8 tokens,
  as a chat template's preamble does; tiny caches), looked up by prompts that extend a stored one; latency of
  ``Store.lookup_async`` (chain probes and comparisons on a worker thread), p50 and p99, beside a store of whole
  files (v1-style: every entry shares the first token, so the first-token index compares them all; filled with
  ``--v1-conversations``, as its fill is quadratic).

    python scripts/bench/blocks_load.py [--runs 5 --conversations 100000] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

import spilld
from spilld.entries import Hit
from spilld.store import Store

IDENT = spilld.Identity("bench-blocks")


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def big_cache(layers: int, tokens: int, heads: int = 8, dim: int = 128) -> list[Any]:
    out = []
    for i in range(layers):
        c = C.KVCache()
        mx.random.seed(i)
        k, v = (mx.random.normal((1, heads, tokens, dim)).astype(mx.float16) for _ in range(2))
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


async def restore_arms(args: argparse.Namespace, folder: str) -> None:
    caches = big_cache(args.layers, args.tokens)
    tokens = list(range(args.tokens))
    gib = sum(c.keys.nbytes + c.values.nbytes for c in caches) * args.tokens / caches[0].keys.shape[2] / 2**30
    stores = {}
    for name, b in (("one file", 0), ("blocks", args.block_tokens)):
        s = Store(os.path.join(folder, name.replace(" ", "_")), disk_cap=2**42, block_tokens=b)
        await s.put(tokens, caches, IDENT)
        stores[name] = s
    del caches
    print(
        f"restore: {args.layers} layers x 2 x (1, 8, {args.tokens}, 128) f16 = {gib:.3f} GiB, B = {args.block_tokens}"
    )
    print(
        f"  files: one file {stores['one file'].count} + 0 blocks; blocks {len(stores['blocks'].blocks)} + 1 manifest"
    )
    can_drop = drop_page_cache()
    times: dict[tuple[Any, ...], list[float]] = {}  # (arm, cold or warm, run), then (arm, cold or warm)
    for run in range(args.runs):
        order = list(stores) if run % 2 == 0 else list(reversed(stores))
        for name in order:  # each arm cold, then at once warm (its pages are still cached), --warm-repeats times
            for temp in ("cold", *["warm"] * args.warm_repeats):
                s = stores[name]
                if temp == "cold" and can_drop:
                    drop_page_cache()
                hit = s.lookup(IDENT, "", [*tokens, 0])
                assert isinstance(hit, Hit)
                t0 = time.perf_counter()
                got = await s.restore_async(hit, IDENT)
                times.setdefault((name, temp, run), []).append(time.perf_counter() - t0)
                assert not isinstance(got, type(None)) and got.caches[0].offset == args.tokens  # type: ignore[union-attr]
                del got
    for key in list(times):  # one figure per arm and run: the median of its warm restores
        times[key[:2]] = [*times.get(key[:2], []), statistics.median(times.pop(key))]
    for temp in ("cold", "warm"):
        if temp == "cold" and not can_drop:
            print("  cold: not measured (dropping the page cache is not permitted here)")
            continue
        one, blk = times[("one file", temp)], times[("blocks", temp)]
        ratios = [b / o for b, o in zip(blk, one, strict=True)]
        print(
            f"  {temp}: one file {statistics.median(one) * 1e3:.1f} ms ({gib * 2**30 / 1e9 / statistics.median(one):.2f} GB/s),"
            f" blocks {statistics.median(blk) * 1e3:.1f} ms ({gib * 2**30 / 1e9 / statistics.median(blk):.2f} GB/s);"
            f" blocks / one file per run {', '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}"
        )


def tiny(n: int, seed: int) -> list[Any]:
    c = C.KVCache()
    mx.random.seed(seed)
    c.update_and_fetch(*(mx.random.normal((1, 1, n, 16)).astype(mx.float16) for _ in range(2)))
    mx.eval(c.keys, c.values)
    return [c]


async def lookup_arms(args: argparse.Namespace, folder: str) -> None:
    rng = random.Random(7)
    preamble = list(range(8))
    convs = [
        preamble + [rng.randrange(1000, 60000) for _ in range(args.conv_tokens - 8)] for _ in range(args.conversations)
    ]
    cache = tiny(args.conv_tokens, 0)  # the same rows for every conversation: the lookup never reads them
    print(f"lookup: {args.conversations} conversations of {args.conv_tokens} tokens, B = {args.lookup_block}")
    for name, b in (("blocks", args.lookup_block), ("one file", 0)):
        if b == 0:  # every put's supersede compares the whole first-token group too: O(n^2) to fill
            convs = convs[: args.v1_conversations]
        s = Store(os.path.join(folder, f"lookup_{b}"), disk_cap=2**42, block_tokens=b, durability="none")
        t0 = time.perf_counter()
        for t in convs:
            await s.put(t, cache, IDENT)
        fill_s = time.perf_counter() - t0
        lat = []
        for t in rng.sample(convs, min(args.queries, len(convs))):
            q0 = time.perf_counter()
            hit = await s.lookup_async(IDENT, "", [*t, 5, 6])
            lat.append(time.perf_counter() - q0)
            assert isinstance(hit, Hit) and hit.matched == len(t)
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(
            f"  {name}: {s.count} entries, {len(s.blocks)} blocks (filled in {fill_s:.0f} s); lookup p50"
            f" {statistics.median(lat) * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms ({len(lat)} lookups)"
        )
        shutil.rmtree(s.root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--warm-repeats", type=int, default=3, help="warm restores per arm and run after the cold one (their median)"
    )
    ap.add_argument("--conversations", type=int, default=100_000)
    ap.add_argument("--v1-conversations", type=int, default=5000, help="entries in the whole-file arm")
    ap.add_argument("--conv-tokens", type=int, default=40)
    ap.add_argument("--lookup-block", type=int, default=16)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--only", choices=["restore", "lookup"], default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.tokens, args.runs, args.conversations, args.queries = 2, 300, 2, 40, 40
        args.v1_conversations = 40
    with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
        if args.only in (None, "restore"):
            asyncio.run(restore_arms(args, folder))
        if args.only in (None, "lookup"):
            asyncio.run(lookup_arms(args, folder))


if __name__ == "__main__":
    main()
