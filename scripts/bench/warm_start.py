"""Warm start (issue 16.4): the first restore after a daemon restart, with the read-ahead and without.

A daemon holds one conversation's cache (synthetic: ``--layers`` layers of K and V f16 ``(1, 8, T, 128)``,
``--mib`` MiB, in blocks of 64) and a few older ones. Per run, arms alternating: the daemon is stopped, every file of
its store is dropped from the page cache (``posix_fadvise(DONTNEED)`` after a sync; also ``drop_caches`` when
permitted), and it is started again, with ``--warm-bytes`` (warm arm; the restore waits until ``status`` says the
read-ahead is done, and that wait is reported too) or with ``--warm-bytes 0`` (cold arm). Then the newest
conversation is restored through the client (lookup, read, every hash checked) and timed.

    python scripts/bench/warm_start.py [--mib 512 --runs 5] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

import spilld
from spilld.daemon.listen import is_served

IDENT = spilld.Identity("bench-warm-start")


def kv(layers: int, tokens: int, seed: int) -> list[Any]:
    out = []
    for i in range(layers):
        c = C.KVCache()
        mx.random.seed(seed * 1000 + i)
        c.update_and_fetch(*(mx.random.normal((1, 8, tokens, 128)).astype(mx.float16) for _ in range(2)))
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def evict_page_cache(folder: str) -> None:
    os.sync()
    for dirpath, _, names in os.walk(folder):
        for n in names:
            try:
                fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        pass


class Daemon:
    def __init__(self, root: str) -> None:
        self.root, self.sock, self.proc = root, os.path.join(root, "s.sock"), None
        self.dir = os.path.join(root, "store")

    def start(self, *extra: str) -> None:
        cmd = [sys.executable, "-m", "spilld", "--dir", self.dir, "--socket", self.sock, "--cap", "2GiB", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not is_served(self.sock):  # accepting, not only bound (a refused connect raced the listen)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the daemon did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=120)
            self.proc = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512, help="MiB of the newest conversation's cache (default 512)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--older", type=int, default=3, help="older conversations (a quarter the size each)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="8 MiB, 1 run (CI)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.mib, args.layers, args.older, args.runs = 8, 4, 1, 1
    per_token = args.layers * 2 * 8 * 128 * 2
    tokens = args.mib * 2**20 // per_token
    root = tempfile.mkdtemp(prefix="spilld-bench-warm-", dir="/var/tmp")
    d = Daemon(root)
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    warmup: list[float] = []
    try:
        d.start()
        with spilld.Client(d.sock, identity=IDENT, name="bench") as c:
            for i in range(args.older):  # older conversations: read ahead after the newest, if the budget allows
                toks = list(range(10_000 * (i + 1), 10_000 * (i + 1) + tokens // 4))
                if not c.spill(toks, kv(args.layers, len(toks), seed=i + 1), droppable=False).result(600).stored:
                    raise RuntimeError("not stored")
            newest = list(range(tokens))
            if not c.spill(newest, kv(args.layers, tokens, seed=0), droppable=False).result(600).stored:
                raise RuntimeError("not stored")
        for run in range(args.runs):
            for arm in ("cold", "warm") if run % 2 == 0 else ("warm", "cold"):
                d.stop()
                evict_page_cache(d.dir)
                t_start = time.perf_counter()
                d.start("--warm-bytes", "0" if arm == "cold" else f"{args.mib + 64}MiB", "--warm-rate", "2GiB")
                with spilld.Client(d.sock, identity=IDENT, name="bench") as c:
                    if arm == "warm":
                        while not c.status()["warm"]["done"]:
                            time.sleep(0.02)
                        warmup.append(time.perf_counter() - t_start)
                    t0 = time.perf_counter()
                    got = c.load([*newest, 1])
                    times[arm].append(time.perf_counter() - t0)
                    if got is None or len(got.tokens) != tokens:
                        raise RuntimeError("the newest conversation was not restored")
                    del got
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "mib": args.mib, "runs": args.runs, "seconds": times, "warmup_seconds": warmup,
        "median_ms": {k: round(1e3 * v, 1) for k, v in med.items()},
        "warm_over_cold": round(med["warm"] / med["cold"], 3),
    }  # fmt: skip
    print(
        f"first restore after a restart, {args.mib} MiB, {args.runs} runs, medians: without read-ahead "
        f"{out['median_ms']['cold']} ms, with it {out['median_ms']['warm']} ms ({out['warm_over_cold']}x); "
        f"read-ahead done {1e3 * statistics.median(warmup):.0f} ms after the daemon was started"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
