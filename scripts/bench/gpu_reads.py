"""How a spill's reads of an engine's arrays disturb decode on a GPU (issue 16, item 2): a probe, not spilld itself.

    python scripts/bench/gpu_reads.py [--rounds 4] [--smoke]

On mlx's CUDA backend every array is CUDA managed memory: a CPU thread that hashes or writes an array's bytes
faults its pages over to the host. This measures a decode-like loop (8 bf16 4096x4096 matmuls a step, under a
``spilld.FairLock`` as an engine's generation lock) while another thread reads 512 MiB of fresh GPU arrays (xxh3
over their bytes, nothing written) in one of these ways, arms alternating in each round:

- ``idle``: no reader;
- ``whole``: each 16 MiB array hashed in one call, as fast as it goes;
- ``prefetch``: each array first moved to the host in bulk with ``cudaMemPrefetchAsync`` on a stream of its own
  (CUDA only), then hashed;
- ``pieces_16k``: 16 KiB chunks, unpaced: much more of the reader's own Python between reads (the GIL);
- ``paced_2m`` / ``paced_256k``: chunks of 2 MiB / 256 KiB, paced to ``--rate`` (default 1.5 GB/s);
- ``lease_4m`` / ``lease_1m``: chunks of 4 MiB / 1 MiB, each read while holding the engine's lock (between steps).

For each arm: per-step latency p50 and p99 (the decode runs at least 300 steps and as long as the reader does) and
the reader's GB/s. ``--smoke`` runs a few steps of every arm that the machine has (on a CPU-only mlx the prefetch
arm is left out) and exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from spilld import mlxthreads
from spilld.lease import FairLock

LOCK = FairLock()  # the engine's generation lock
_MEM_LOCATION_HOST = 2  # cudaMemLocationTypeHost (CUDA 13's cudaMemPrefetchAsync takes a location)


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int), ("device", ctypes.c_int), ("dptr", ctypes.c_void_p), ("hptr", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),  # room for fields a newer CUDA adds: it writes the whole struct
    ]  # fmt: skip


def cudart() -> Any:
    """The CUDA runtime mlx has loaded (the same copy: two runtimes in one process crash), None without CUDA."""
    with open("/proc/self/maps") as f:
        loaded = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for path in loaded or sorted(p for d in dirs for p in glob.glob(os.path.join(d, "libcudart.so.1[3-9]*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def address(a: mx.array) -> tuple[int, int]:
    mv = memoryview(a)  # type: ignore[arg-type]
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data), mv.nbytes


class Prefetcher:
    """Moves an array's pages to the host in bulk, on a CUDA stream of its own."""

    def __init__(self, rt: Any) -> None:
        self.rt, self.stream = rt, ctypes.c_void_p()
        if rt.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1) != 0:  # non-blocking
            raise RuntimeError("cudaStreamCreateWithFlags failed")

    def __call__(self, a: mx.array) -> None:
        p, n = address(a)
        loc = _Loc(_MEM_LOCATION_HOST, 0)
        if self.rt.cudaMemPrefetchAsync(ctypes.c_void_p(p), ctypes.c_size_t(n), loc, ctypes.c_uint(0), self.stream):
            raise RuntimeError("cudaMemPrefetchAsync failed")
        if self.rt.cudaStreamSynchronize(self.stream):
            raise RuntimeError("cudaStreamSynchronize failed")


def memory_kind(rt: Any, a: mx.array) -> str:
    attr = _Attr()
    p, _ = address(a)
    if rt is None or rt.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(p)) != 0:
        return "host (no CUDA)"
    return {1: "host", 2: "device", 3: "managed"}.get(attr.type, f"type {attr.type}")


def weights(hidden: int) -> tuple[list[mx.array], mx.array]:
    mx.random.seed(0)
    w = [mx.random.normal((hidden, hidden)).astype(mx.bfloat16) for _ in range(8)]
    x = mx.random.normal((1, hidden)).astype(mx.bfloat16)
    mx.eval(w, x)
    return w, x


def arrays(count: int, mib: int, seed: int) -> list[mx.array]:
    mx.random.seed(seed)
    out = [mx.random.normal((mib * 2**20 // 2,)).astype(mx.bfloat16) for _ in range(count)]
    mx.eval(out)
    return out


def decode(w: list[mx.array], x: mx.array, steps: int) -> list[float]:
    lat, y = [], x
    for _ in range(steps):
        t = time.perf_counter()
        with LOCK:
            for m in w:
                y = (y @ m) * 0.01
            mx.eval(y)
        lat.append(time.perf_counter() - t)
    return lat


def read(arrs: list[mx.array], chunk: int | None, rate: float | None, locked: bool, pre: Any = None) -> float:
    """Hash every array's bytes in ``chunk``-byte pieces (None: whole), paced to ``rate``; the reader's GB/s."""
    t, n = time.perf_counter(), 0
    for a in arrs:
        if pre is not None:
            pre(a)
        mv = memoryview(a).cast("B")  # type: ignore[arg-type]
        h = xxhash.xxh3_64()
        step = chunk or mv.nbytes
        for o in range(0, mv.nbytes, step):
            if locked:
                with LOCK:
                    h.update(mv[o : o + step])
            else:
                h.update(mv[o : o + step])
            n += min(step, mv.nbytes - o)
            if rate is not None and (ahead := n / rate - (time.perf_counter() - t)) > 0:
                time.sleep(ahead)
        h.digest()
        mv.release()
    return n / (time.perf_counter() - t) / 1e9


def arms(rate: float, rt: Any) -> dict[str, Callable[[list[mx.array]], float] | None]:
    out: dict[str, Callable[[list[mx.array]], float] | None] = {
        "idle": None,
        "whole": lambda arrs: read(arrs, None, None, False),
    }
    if rt is not None:
        pre = Prefetcher(rt)
        out["prefetch"] = lambda arrs: read(arrs, None, None, False, pre)
    out |= {
        "pieces_16k": lambda arrs: read(arrs, 16 << 10, None, False),  # Python between small reads: GIL churn
        "paced_2m": lambda arrs: read(arrs, 2 << 20, rate, False),
        "paced_256k": lambda arrs: read(arrs, 256 << 10, rate, False),
        "lease_4m": lambda arrs: read(arrs, 4 << 20, None, True),
        "lease_1m": lambda arrs: read(arrs, 1 << 20, None, True),
    }
    return out


def run_into(fn: Callable[[list[mx.array]], float], arrs: list[mx.array], got: dict[str, float]) -> None:
    got["gbps"] = fn(arrs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="decode steps per arm, at least")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--arrays", type=int, default=32, help="16 MiB arrays read per arm")
    p.add_argument("--rate", type=float, default=1.5e9, help="bytes/s of the paced arms")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="seconds: a few steps of every arm")
    a = p.parse_args()
    if a.smoke:
        a.rounds, a.steps, a.hidden, a.arrays, a.rate = 1, 5, 256, 2, 1e9
    w, x = weights(a.hidden)  # first: mlx's CUDA runtime is then loaded, and cudart() finds that copy
    rt = cudart() if mx.default_device() == mx.gpu else None
    print(f"cuda runtime: {getattr(rt, '_name', None)}", flush=True)
    print(f"device {mx.default_device()}, arrays are {memory_kind(rt, arrays(1, 1, 0)[0])} memory", flush=True)
    decode(w, x, 20)
    rows: list[dict[str, Any]] = []
    readers = arms(a.rate, rt)
    for rnd in range(a.rounds):
        for name, fn in readers.items():
            arrs = arrays(a.arrays, 16, seed=rnd * 100 + len(rows))
            got: dict[str, float] = {}
            th = mlxthreads.start_thread(functools.partial(run_into, fn, arrs, got), "reader") if fn else None
            lat = decode(w, x, a.steps)
            while th is not None and th.is_alive():  # decode for as long as the reader runs
                lat += decode(w, x, 20)
            if th is not None:
                th.join()
            lat.sort()
            row = {"round": rnd, "arm": name, "steps": len(lat), "p50_ms": statistics.median(lat) * 1e3,
                   "p99_ms": lat[max(0, int(0.99 * len(lat)) - 1)] * 1e3, "gbps": got.get("gbps", 0.0)}  # fmt: skip
            rows.append(row)
            print(f"round {rnd} {name:11s} steps {row['steps']:5d} p50 {row['p50_ms']:.3f} ms p99 {row['p99_ms']:.3f}"
                  f" ms, reader {row['gbps']:.2f} GB/s", flush=True)  # fmt: skip
    for name in readers:
        ratios = [r["p99_ms"] / i["p99_ms"] for r in rows if r["arm"] == name
                  for i in rows if i["arm"] == "idle" and i["round"] == r["round"]]  # fmt: skip
        print(f"{name:11s} p99 / idle per round {', '.join(f'{q:.2f}' for q in ratios)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: a CUDA stream made through ctypes can crash mlx's exit handlers


if __name__ == "__main__":
    raise SystemExit(main())
