#!/usr/bin/env python3
"""Save and load benchmark: spilld against an O_DIRECT ceiling, mlx-lm and mx.safetensors.

A synthetic prompt cache (default 32 layers of ``KVCache``, K and V float16
``(1, 8, 8192, 128)``, exactly 1 GiB of live tensor data) is saved by four arms
and loaded by five, interleaved round-robin with the order rotated each run:

save (time until durable, each arm writes a NEW file, deleted afterwards)
  spilld       ``spilld.save(path, tokens, caches, durability="fsync")``
  ceiling      O_DIRECT: posix_fallocate + 16 MiB page-aligned buffer written N times + fsync
  mlx_lm       ``mlx_lm.models.cache.save_prompt_cache`` + fsync of the file
  safetensors  ``mx.save_safetensors`` + fsync of the file

load (cold after ``sync; echo 3 > /proc/sys/vm/drop_caches``, then warm right after)
  spilld            ``spilld.load(path)`` (hash verification on)
  spilld_noverify   ``spilld.load(path, verify=False)``
  mlx_lm            ``load_prompt_cache`` + ``mx.eval``
  safetensors       ``mx.load`` + ``mx.eval``
  raw               ``mx.zeros`` + ``mx.eval`` + ``os.preadv`` into the array, per tensor
  raw_qd            ``np.empty`` (no zero fill) + ``os.preadv`` of 4 MiB chunks on RAW_QD threads (queue depth 4)
  memcpy_fresh      warm only: a copy of the live bytes into ``np.empty`` buffers on LOAD_THREADS threads
                    (fresh pages, as every load gets): the machine's ceiling for a load from the page cache
  memcpy            warm only: the same copy into pages touched before: the memory bandwidth

``--sizes 256MiB,1GiB,4GiB`` runs only the load phase at each size (``--plot`` draws GB/s by size).

A diagnostics phase then splits spilld's save and load time into syscalls
(through an instrumented ``FileOps``), hashing and allocation.

GB/s is always bytes of live tensor data (1e9 bytes) per second.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models import cache as mlc

import spilld
import spilld.loader as spilld_loader
import spilld.saver.tensorbytes as spilld_tensorbytes  # where a save hashes (timed by --diag)
from spilld.fileio import Durability, FileOps

GB = 1e9
PAGE = 4096
CHUNK = 4 * 2**20  # bytes per read or copy call of the raw_qd and memcpy arms
RAW_QD = 4  # reads in flight in the raw_qd arm (issue 16: "queue depth >= 4")
WARM_ONLY = ("memcpy_fresh", "memcpy")  # ceilings, not loads: nothing to read cold


# ---------------------------------------------------------------- helpers


def byte_view(a: Any) -> memoryview:
    """The zero-copy bytes of an evaluated mx array or a numpy array."""
    return memoryview(a).cast("B")


def clear() -> None:
    gc.collect()
    if hasattr(mx, "clear_cache"):
        mx.clear_cache()


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_and_settle(path: str) -> None:
    """Remove a file and commit the removal (ext4 discard runs at journal commit), untimed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.sync()


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rotated(items: Sequence[str], run: int) -> list[str]:
    k = run % len(items)
    return [*items[k:], *items[:k]]


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(folder: str) -> dict[str, Any]:
    cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_total": sh("grep MemTotal /proc/meminfo"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_lm": sh(f"{sys.executable} -c 'import mlx_lm; print(mlx_lm.__version__)'"),
        "spilld_commit": sh("git -C " + os.path.dirname(os.path.abspath(__file__)) + " rev-parse --short HEAD"),
        "dir": folder,
        "df": sh(f"df -T {folder} | tail -1"),
        "mount": sh(f"findmnt -no SOURCE,FSTYPE,OPTIONS -T {folder}"),
    }


# ---------------------------------------------------------------- the synthetic cache


@dataclass
class Shape:
    layers: int
    tokens: int
    heads: int
    dim: int

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (1, self.heads, self.tokens, self.dim)

    @property
    def tensor_bytes(self) -> int:
        return self.heads * self.tokens * self.dim * 2  # float16

    @property
    def n_tensors(self) -> int:
        return 2 * self.layers

    @property
    def live_bytes(self) -> int:
        return self.n_tensors * self.tensor_bytes


def build_caches(s: Shape) -> list[mlc.KVCache]:
    """One ``update_and_fetch`` of ``tokens`` rows per layer, random float16 data."""
    mx.random.seed(0)
    caches = []
    for _ in range(s.layers):
        c = mlc.KVCache()
        k = mx.random.normal(s.kv_shape).astype(mx.float16)
        v = mx.random.normal(s.kv_shape).astype(mx.float16)
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        del k, v
        caches.append(c)
    clear()
    return caches


def live_arrays(caches: Sequence[mlc.KVCache]) -> list[mx.array]:
    """Keys and values of every layer cut to ``offset`` (the whole buffer when it is exactly full)."""
    out = []
    for c in caches:
        for a in (c.keys, c.values):
            out.append(a if a.shape[2] == c.offset else a[..., : c.offset, :])
    mx.eval(out)
    return out


# ---------------------------------------------------------------- instrumented file ops


class TimedOps(FileOps):
    """``FileOps`` that adds up the seconds spent in each syscall."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self._dir_fds: set[int] = set()

    @contextlib.contextmanager
    def _tm(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] += time.perf_counter() - t0
            self.n[name] += 1

    def open_new(self, path: str, flags: int = 0) -> int:
        with self._tm("open"):
            return super().open_new(path, flags)

    def open_read(self, path: str) -> int:
        with self._tm("open"):
            return super().open_read(path)

    def open_dir(self, path: str) -> int:
        with self._tm("open_dir"):
            fd = super().open_dir(path)
        self._dir_fds.add(fd)
        return fd

    def fallocate(self, fd: int, size: int) -> None:
        with self._tm("fallocate"):
            super().fallocate(fd, size)

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        with self._tm("pwritev"):
            return super().pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        with self._tm("preadv"):
            return super().preadv(fd, bufs, offset)

    def fsync(self, fd: int, durability: Durability) -> None:
        with self._tm("fsync_dir" if fd in self._dir_fds else "fsync_file"):
            super().fsync(fd, durability)

    def close(self, fd: int) -> None:
        self._dir_fds.discard(fd)
        with self._tm("close"):
            super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        with self._tm("rename"):
            super().rename(src, dst)

    def unlink(self, path: str) -> None:
        with self._tm("unlink"):
            super().unlink(path)


class _TimedHash:
    def __init__(self, owner: HashTimer) -> None:
        self._h = xxhash.xxh3_64()
        self._owner = owner

    def update(self, data: Any) -> None:
        t0 = time.perf_counter()
        self._h.update(data)
        self._owner.s += time.perf_counter() - t0

    def digest(self) -> bytes:
        return self._h.digest()


class HashTimer:
    """Stands in for the ``xxhash`` module inside a spilld module, adding up the seconds spent hashing."""

    def __init__(self) -> None:
        self.s = 0.0

    def xxh3_64(self) -> _TimedHash:
        return _TimedHash(self)


@contextlib.contextmanager
def timed_hash(module: Any) -> Iterator[HashTimer]:
    """Swap ``module.xxhash`` for a ``HashTimer`` for the duration (diagnostics only)."""
    timer = HashTimer()
    original = module.xxhash
    module.xxhash = timer
    try:
        yield timer
    finally:
        module.xxhash = original


# ---------------------------------------------------------------- the benchmark


@dataclass
class Bench:
    shape: Shape
    folder: str
    runs: int
    caches: list[mlc.KVCache]
    tokens: list[int]
    cold_ok: bool = True
    results: dict[str, Any] = field(default_factory=dict)
    _buf: mmap.mmap | None = None
    _bounce: list[mmap.mmap] = field(default_factory=list)
    _touched: list[np.ndarray] = field(default_factory=list)

    @property
    def live(self) -> int:
        return self.shape.live_bytes

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    # ---- save arms (each returns when the file is durable)

    def save_spilld(self, path: str) -> None:
        spilld.save(path, self.tokens, self.caches, durability="fsync")

    def _aligned_buffer(self) -> tuple[mmap.mmap, int]:
        """One reused, page-aligned, pre-touched buffer of one tensor (rounded up to a page)."""
        size = -(-self.shape.tensor_bytes // PAGE) * PAGE
        if self._buf is None:
            buf = mmap.mmap(-1, size)
            src = byte_view(live_arrays(self.caches[:1])[0])  # filled once, so pre-touched
            buf[: src.nbytes] = src
            src.release()
            self._buf = buf
        return self._buf, size

    def save_ceiling(self, path: str) -> None:
        buf, size = self._aligned_buffer()
        total = size * self.shape.n_tensors
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o644)
        try:
            os.posix_fallocate(fd, 0, total)
            for i in range(self.shape.n_tensors):
                off = i * size
                done = 0
                while done < size:
                    n = os.pwrite(fd, memoryview(buf)[done:], off + done)
                    if n <= 0:
                        raise OSError("O_DIRECT write made no progress")
                    done += n
            os.fsync(fd)
        finally:
            os.close(fd)

    def save_mlx_lm(self, path: str) -> None:
        mlc.save_prompt_cache(path, self.caches)
        fsync_path(path)

    def save_safetensors(self, path: str) -> None:
        arrays = live_arrays(self.caches)
        mx.save_safetensors(path, {f"t{i}": a for i, a in enumerate(arrays)})
        del arrays
        fsync_path(path)

    # ---- load arms (each returns evaluated arrays, kept alive until timing ends)

    def load_spilld(self, path: str) -> Any:
        return spilld.load(path).caches

    def load_spilld_noverify(self, path: str) -> Any:
        return spilld.load(path, verify=False).caches

    def load_mlx_lm(self, path: str) -> Any:
        caches = mlc.load_prompt_cache(path)
        mx.eval([a for c in caches for a in (c.keys, c.values) if a is not None])
        return caches

    def load_safetensors(self, path: str) -> Any:
        arrays = cast(dict[str, mx.array], mx.load(path))
        mx.eval(list(arrays.values()))
        return arrays

    def load_raw(self, path: str) -> Any:
        out = []
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            off = 0
            for _ in range(self.shape.n_tensors):
                arr = mx.zeros(self.shape.kv_shape, mx.float16)
                mx.eval(arr)
                mv = byte_view(arr)
                done = 0
                while done < mv.nbytes:
                    n = os.preadv(fd, [mv[done:]], off + done)
                    if n <= 0:
                        raise OSError("raw file ended early")
                    done += n
                mv.release()
                off += done
                out.append(arr)
        finally:
            os.close(fd)
        return out

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(o, min(CHUNK, nbytes - o)) for o in range(0, nbytes, CHUNK)]

    def load_raw_qd(self, path: str) -> Any:
        """The stronger raw arm: no zero fill, ``RAW_QD`` reads in flight."""
        size = self.shape.tensor_bytes
        out = [np.empty(size, np.uint8) for _ in range(self.shape.n_tensors)]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

        def read(i: int, o: int, n: int) -> None:
            mv = byte_view(out[i])[o : o + n]
            done = 0
            while done < n:
                got = os.preadv(fd, [mv[done:]], i * size + o + done)
                if got <= 0:
                    raise OSError("raw file ended early")
                done += got

        try:
            with ThreadPoolExecutor(RAW_QD) as pool:
                jobs = [pool.submit(read, i, o, n) for i in range(len(out)) for o, n in self._chunks(size)]
                for j in jobs:
                    j.result()
        finally:
            os.close(fd)
        return out

    def _memcpy(self, dest: list[np.ndarray]) -> list[np.ndarray]:
        src = [np.frombuffer(byte_view(a), np.uint8) for a in live_arrays(self.caches)]
        with ThreadPoolExecutor(spilld_loader.LOAD_THREADS) as pool:
            jobs = [
                pool.submit(np.copyto, d[o : o + n], s[o : o + n])
                for s, d in zip(src, dest, strict=True)
                for o, n in self._chunks(s.nbytes)
            ]
            for j in jobs:
                j.result()
        return dest

    def load_memcpy_fresh(self, path: str) -> Any:
        return self._memcpy([np.empty(self.shape.tensor_bytes, np.uint8) for _ in range(self.shape.n_tensors)])

    def load_memcpy(self, path: str) -> Any:
        return self._memcpy(self._touched)

    # ---- phases

    def save_phase(self) -> dict[str, list[float]]:
        arms: dict[str, Callable[[str], None]] = {
            "spilld": self.save_spilld,
            "ceiling": self.save_ceiling,
            "mlx_lm": self.save_mlx_lm,
            "safetensors": self.save_safetensors,
        }
        self._aligned_buffer()  # pre-touched once, outside the timing
        out: dict[str, list[float]] = {k: [] for k in arms}
        for run in range(self.runs):
            order = rotated(list(arms), run)
            print(f"save run {run + 1}/{self.runs}: order {', '.join(order)}", flush=True)
            for name in order:
                ext = "safetensors" if name in ("mlx_lm", "safetensors") else "bin"
                path = self.path(f"save-{name}-{run}.{ext}")
                clear()
                os.sync()
                t0 = time.perf_counter()
                arms[name](path)
                dt = time.perf_counter() - t0
                size = os.path.getsize(path)
                unlink_and_settle(path)
                out[name].append(self.live / dt / GB)
                print(f"  {name:<12} {dt * 1e3:8.1f} ms  {out[name][-1]:6.2f} GB/s  (file {size / 2**20:.1f} MiB)")
        return out

    def write_load_files(self) -> dict[str, str]:
        """The files the load arms read, written once (durably) before any load timing."""
        files = {
            "spilld": self.path("load.spilld"),
            "mlx_lm": self.path("load-mlx_lm.safetensors"),
            "safetensors": self.path("load-mx.safetensors"),
            "raw": self.path("load.raw"),
        }
        self.save_spilld(files["spilld"])
        self.save_mlx_lm(files["mlx_lm"])
        self.save_safetensors(files["safetensors"])
        arrays = live_arrays(self.caches)
        fd = os.open(files["raw"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            off = 0
            for a in arrays:
                mv = byte_view(a)
                done = 0
                while done < mv.nbytes:
                    done += os.pwrite(fd, mv[done:], off + done)
                off += mv.nbytes
                mv.release()
            os.fsync(fd)
        finally:
            os.close(fd)
        del arrays
        for k, p in files.items():
            print(f"  load file {k:<12} {os.path.getsize(p) / 2**20:8.1f} MiB  {p}")
        self.check_loads(files)
        return files

    def check_loads(self, files: dict[str, str]) -> None:
        """Untimed: every load arm gives back the saved data (first and last tensor)."""
        ref = live_arrays(self.caches)
        first, last = ref[0], ref[-1]
        n = self.shape.tokens
        got = self.load_spilld(files["spilld"])
        assert mx.array_equal(got[0].keys[..., :n, :], first).item()
        assert mx.array_equal(got[-1].values[..., :n, :], last).item()
        got = self.load_mlx_lm(files["mlx_lm"])
        assert mx.array_equal(got[0].keys[..., :n, :], first).item()
        assert mx.array_equal(got[-1].values[..., :n, :], last).item()
        got = self.load_safetensors(files["safetensors"])
        assert mx.array_equal(got["t0"], first).item()
        assert mx.array_equal(got[f"t{self.shape.n_tensors - 1}"], last).item()
        got = self.load_raw(files["raw"])
        assert mx.array_equal(got[0], first).item()
        assert mx.array_equal(got[-1], last).item()
        got = self.load_raw_qd(files["raw"])
        assert bytes(got[0]) == bytes(byte_view(first)) and bytes(got[-1]) == bytes(byte_view(last))
        del got, ref, first, last
        clear()
        print("  every load arm returns the saved data", flush=True)

    def load_phase(self, files: dict[str, str]) -> dict[str, dict[str, list[float]]]:
        arms: dict[str, tuple[Callable[[str], Any], str]] = {
            "spilld": (self.load_spilld, files["spilld"]),
            "spilld_noverify": (self.load_spilld_noverify, files["spilld"]),
            "mlx_lm": (self.load_mlx_lm, files["mlx_lm"]),
            "safetensors": (self.load_safetensors, files["safetensors"]),
            "raw": (self.load_raw, files["raw"]),
            "raw_qd": (self.load_raw_qd, files["raw"]),
            "memcpy_fresh": (self.load_memcpy_fresh, ""),
            "memcpy": (self.load_memcpy, ""),
        }
        out: dict[str, dict[str, list[float]]] = {k: {"cold": [], "warm": []} for k in arms}
        self._touched = [np.ones(self.shape.tensor_bytes, np.uint8) for _ in range(self.shape.n_tensors)]
        for run in range(self.runs):
            order = rotated(list(arms), run)
            print(f"load run {run + 1}/{self.runs}: order {', '.join(order)}", flush=True)
            for name in order:
                fn, path = arms[name]
                line = f"  {name:<16}"
                for mode in ("cold", "warm"):
                    if mode == "cold":
                        if not self.cold_ok or name in WARM_ONLY:
                            continue
                        clear()
                        if not drop_page_cache():
                            self.cold_ok = False
                            print("  NOTE: drop_caches not permitted; skipping cold loads", flush=True)
                            continue
                    else:
                        clear()
                    t0 = time.perf_counter()
                    got = fn(path)
                    dt = time.perf_counter() - t0
                    del got
                    out[name][mode].append(self.live / dt / GB)
                    line += f"  {mode} {dt * 1e3:7.1f} ms {out[name][mode][-1]:6.2f} GB/s"
                print(line, flush=True)
                clear()
        return out

    def _bounce_buffers(self, k: int) -> list[mmap.mmap]:
        """``k`` page-aligned, pre-touched buffers of one tensor (rounded up to a page), made once."""
        size = -(-self.shape.tensor_bytes // PAGE) * PAGE
        while len(self._bounce) < k:
            buf = mmap.mmap(-1, size)
            buf[:] = b"\1" * size
            self._bounce.append(buf)
        return self._bounce[:k]

    def odirect_bounce_save(self, path: str, arrays: Sequence[mx.array], writers: int) -> dict[str, float]:
        """What an O_DIRECT spilld could do: xxh3 + copy each tensor into an aligned buffer, write, fsync.

        ``writers`` 0: all serial on this thread. ``writers`` >= 1: 4 buffers, the writes on that
        many worker threads, so hash and copy of tensor i overlap the write of tensor i-1.
        """
        bufs = self._bounce_buffers(4)
        size = len(bufs[0])
        t: dict[str, float] = defaultdict(float)
        t_start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o644)
        pool = ThreadPoolExecutor(writers) if writers else None
        pending: list[Future[int] | None] = [None] * len(bufs)
        try:
            os.posix_fallocate(fd, 0, size * len(arrays))
            for i, a in enumerate(arrays):
                mv = byte_view(a)
                t0 = time.perf_counter()
                h = xxhash.xxh3_64()
                h.update(mv)
                h.digest()
                t1 = time.perf_counter()
                slot = i % len(bufs)
                prev = pending[slot]
                if prev is not None:
                    prev.result()
                buf = bufs[slot]
                t2 = time.perf_counter()
                buf[: mv.nbytes] = mv
                t3 = time.perf_counter()
                mv.release()
                t["hash"] += t1 - t0
                t["copy"] += t3 - t2
                if pool is None:
                    if os.pwrite(fd, buf, i * size) != size:
                        raise OSError("short O_DIRECT write")
                    t["write"] += time.perf_counter() - t3
                else:
                    pending[slot] = pool.submit(os.pwrite, fd, buf, i * size)
            for f in pending:
                if f is not None and f.result() != size:
                    raise OSError("short O_DIRECT write")
            t0 = time.perf_counter()
            os.fsync(fd)
            t["fsync"] = time.perf_counter() - t0
        finally:
            if pool is not None:
                pool.shutdown()
            os.close(fd)
        t["total"] = time.perf_counter() - t_start
        return dict(t)

    def raw_split(self, path: str) -> dict[str, float]:
        """The raw load arm with its two parts timed apart: mx.zeros + eval, and preadv."""
        t: dict[str, float] = defaultdict(float)
        out = []
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            off = 0
            for _ in range(self.shape.n_tensors):
                t0 = time.perf_counter()
                arr = mx.zeros(self.shape.kv_shape, mx.float16)
                mx.eval(arr)
                t1 = time.perf_counter()
                mv = byte_view(arr)
                done = 0
                while done < mv.nbytes:
                    done += os.preadv(fd, [mv[done:]], off + done)
                mv.release()
                off += done
                out.append(arr)
                t["alloc"] += t1 - t0
                t["read"] += time.perf_counter() - t1
        finally:
            os.close(fd)
        del out
        return dict(t)

    def raw_np_empty(self, path: str) -> None:
        """preadv into ``np.empty`` buffers: no zero fill, the pages fault in during the copy."""
        out = []
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            off = 0
            for _ in range(self.shape.n_tensors):
                a = np.empty(self.shape.tensor_bytes, np.uint8)
                done = 0
                while done < a.nbytes:
                    done += os.preadv(fd, [byte_view(a)[done:]], off + done)
                off += done
                out.append(a)
        finally:
            os.close(fd)
        del out

    def diag_phase(self, files: dict[str, str], runs: int) -> dict[str, Any]:
        """Where spilld's time goes: syscalls, hashing, allocation, durability, an O_DIRECT alternative."""
        d: dict[str, list[Any]] = defaultdict(list)
        arrays = live_arrays(self.caches)
        self._bounce_buffers(4)  # pre-touched outside the timing
        for run in range(runs):
            print(f"diagnostics run {run + 1}/{runs}", flush=True)
            # in-memory xxh3 of every live tensor (what save and verified load both pay)
            clear()
            t0 = time.perf_counter()
            for a in arrays:
                mv = byte_view(a)
                h = xxhash.xxh3_64()
                h.update(mv)
                h.digest()
                mv.release()
            d["hash_s"].append(time.perf_counter() - t0)
            # spilld save, fsync: syscalls and hashing timed apart
            ops = TimedOps()
            path = self.path(f"diag-{run}.spilld")
            clear()
            os.sync()
            with timed_hash(spilld_tensorbytes) as ht:
                t0 = time.perf_counter()
                spilld.save(path, self.tokens, self.caches, durability="fsync", ops=ops)
                total = time.perf_counter() - t0
            unlink_and_settle(path)
            d["save_fsync_total_s"].append(total)
            d["save_fsync_ops_s"].append({**ops.t, "xxh3": ht.s})
            # spilld save, durability none (no fsync at all), then how long the flush takes
            path = self.path(f"diag-none-{run}.spilld")
            clear()
            os.sync()
            t0 = time.perf_counter()
            spilld.save(path, self.tokens, self.caches, durability="none")
            d["save_none_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fsync_path(path)
            d["save_none_then_fsync_s"].append(time.perf_counter() - t0)
            unlink_and_settle(path)
            # an O_DIRECT path for spilld's bytes: bounce copy + xxh3, serial, then pipelined
            for label, writers in (("odirect_serial", 0), ("odirect_pipelined", 1)):
                path = self.path(f"diag-{label}-{run}.bin")
                clear()
                os.sync()
                d[f"save_{label}_s"].append(self.odirect_bounce_save(path, arrays, writers))
                unlink_and_settle(path)
            # loads, each cold (after drop_caches) then warm, as in the load phase
            loads: list[tuple[str, Callable[[], Any]]] = [
                ("spilld", lambda: None),
                ("raw_split", lambda: self.raw_split(files["raw"])),
                ("raw_np_empty", lambda: self.raw_np_empty(files["raw"])),
                ("mx_load", lambda: self.load_safetensors(files["safetensors"])),
            ]
            for name, fn in loads:
                for mode in ("cold", "warm"):
                    if mode == "cold" and not self.cold_ok:
                        continue
                    clear()
                    if mode == "cold" and not drop_page_cache():
                        self.cold_ok = False
                        continue
                    ops = TimedOps()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    if name == "spilld":
                        with timed_hash(spilld_loader) as ht:
                            got = spilld.load(files["spilld"], ops=ops)
                            parts: Any = {**ops.t, "xxh3": ht.s}
                    else:
                        got = fn()
                        parts = got if name == "raw_split" else {}
                    total = time.perf_counter() - t0
                    cpu = time.process_time() - c0
                    del got
                    d[f"load_{name}_{mode}_s"].append({"total": total, "cpu": cpu, **parts})
            # allocation alone: mx.zeros + eval of every tensor, at step capacity and exact
            allocs = [("alloc_capacity_s", (self.shape.tokens // 256 + 1) * 256), ("alloc_exact_s", None)]
            for label, rows in allocs if run % 2 == 0 else allocs[::-1]:  # alternate: first touch is order-dependent
                clear()
                shp = list(self.shape.kv_shape)
                if rows is not None:
                    shp[2] = rows
                t0 = time.perf_counter()
                held = []
                for _ in range(self.shape.n_tensors):
                    z = mx.zeros(shp, mx.float16)
                    mx.eval(z)
                    held.append(z)
                d[label].append(time.perf_counter() - t0)
                del held
            # allocation into pages mlx already holds (its buffer cache not cleared)
            gc.collect()
            held = [mx.zeros(self.shape.kv_shape, mx.float16) for _ in range(self.shape.n_tensors)]
            mx.eval(held)
            del held
            gc.collect()
            t0 = time.perf_counter()
            held = []
            for _ in range(self.shape.n_tensors):
                z = mx.zeros(self.shape.kv_shape, mx.float16)
                mx.eval(z)
                held.append(z)
            d["alloc_exact_reused_s"].append(time.perf_counter() - t0)
            del held
            clear()
        del arrays
        clear()
        return dict(d)


# ---------------------------------------------------------------- reporting


def fmt_runs(xs: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs) if xs else "-"


def report(b: Bench, save: dict[str, list[float]], load: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    med_save = {k: median(v) for k, v in save.items()}
    med_load = {k: {m: median(v[m]) for m in ("cold", "warm")} for k, v in load.items()}
    print()
    print(f"live tensor data: {b.live} bytes ({b.live / 2**30:.3f} GiB); GB/s = 1e9 bytes of it per second")
    print()
    print("SAVE until durable, GB/s       runs                      median")
    for k, v in save.items():
        print(f"  {k:<14} {fmt_runs(v):<34} {med_save[k]:6.2f}")
    print()
    print("LOAD to evaluated arrays, GB/s  cold runs (median)            warm runs (median)")
    for k, lv in load.items():
        c, w = med_load[k]["cold"], med_load[k]["warm"]
        print(f"  {k:<16} {fmt_runs(lv['cold']):<20} ({c:5.2f})    {fmt_runs(lv['warm']):<20} ({w:5.2f})")
    ratios = [
        *(
            [
                ("save spilld / ceiling", med_save["spilld"] / med_save["ceiling"], 0.9),
                ("save spilld / mlx_lm", med_save["spilld"] / med_save["mlx_lm"], 1.5),
            ]
            if save
            else []
        ),
        ("warm load spilld / mlx_lm", med_load["spilld"]["warm"] / med_load["mlx_lm"]["warm"], 2.0),
        ("cold load spilld / raw", med_load["spilld"]["cold"] / med_load["raw"]["cold"], 0.9),
        (
            "cold load spilld / raw_qd (queue depth 4, no zero fill)",
            med_load["spilld"]["cold"] / med_load["raw_qd"]["cold"],
            0.9,
        ),
        (
            "(extra) warm load spilld noverify / mlx_lm",
            med_load["spilld_noverify"]["warm"] / med_load["mlx_lm"]["warm"],
            2.0,
        ),
        ("(extra) cold load spilld noverify / raw", med_load["spilld_noverify"]["cold"] / med_load["raw"]["cold"], 0.9),
    ]
    print()
    print("  (memcpy_fresh and memcpy are this machine's ceilings for a warm load, not loads)")
    print()
    print("RATIOS of medians                            ratio  target  ")
    out_ratios = {}
    for name, r, target in ratios:
        ok = r >= target if r == r else False
        print(f"  {name:<56} {r:6.2f}  >= {target:<4}  {'met' if ok else 'MISSED'}")
        out_ratios[name] = {"ratio": r, "target": target, "met": ok}
    return {"median_save_gbps": med_save, "median_load_gbps": med_load, "ratios": out_ratios}


def report_diag(b: Bench, d: dict[str, Any]) -> dict[str, Any]:
    live = b.live

    def ms(xs: Sequence[float]) -> str:
        return " / ".join(f"{x * 1e3:.0f}" for x in xs)

    def part(key: str, name: str) -> str:
        return ms([x.get(name, 0.0) for x in d.get(key, [])])

    def gbps(xs: Sequence[float]) -> str:
        return f"(median {live / median(xs) / GB:.2f} GB/s)"

    def line(label: str, key: str, name: str = "total") -> None:
        if key in d:
            xs = [x.get(name, 0.0) for x in d[key]]
            print(f"  {label:<46} {ms(xs):<20} {gbps(xs) if name == 'total' else ''}")

    print()
    print("DIAGNOSTICS, ms per run")
    print(f"  {'xxh3_64 of all live tensors, in memory':<46} {ms(d['hash_s']):<20} {gbps(d['hash_s'])}")
    print(f"  {'spilld.save fsync, total':<46} {ms(d['save_fsync_total_s']):<20} {gbps(d['save_fsync_total_s'])}")
    ops = ("open", "fallocate", "xxh3", "pwritev", "fsync_file", "rename", "open_dir", "fsync_dir", "close")
    for op in ops:
        print(f"    {op:<44} {part('save_fsync_ops_s', op)}")
    rest = [t - sum(o.values()) for t, o in zip(d["save_fsync_total_s"], d["save_fsync_ops_s"], strict=True)]
    print(f"    {'rest (plan, header, python)':<44} {ms(rest)}")
    print(f"  {'spilld.save durability=none, total':<46} {ms(d['save_none_s']):<20} {gbps(d['save_none_s'])}")
    print(f"    {'then fsync of that file':<44} {ms(d['save_none_then_fsync_s'])}")
    for label, key in (
        ("O_DIRECT + bounce copy + xxh3, serial", "save_odirect_serial_s"),
        ("same, pipelined (4 buffers, 1 writer thread)", "save_odirect_pipelined_s"),
    ):
        line(label, key)
        for p in ("xxh3", "copy", "write", "fsync") if "serial" in key else ("fsync",):
            line(f"  {p}", key, "hash" if p == "xxh3" else p)
    for name, label in (
        ("spilld", "spilld.load (verify)"),
        ("raw_split", "raw: mx.zeros + preadv"),
        ("raw_np_empty", "raw: np.empty + preadv (no zero fill)"),
        ("mx_load", "mx.load + eval (safetensors)"),
    ):
        for mode in ("cold", "warm"):
            key = f"load_{name}_{mode}_s"
            if key not in d:
                continue
            line(f"{label}, {mode}", key)
            line("  process CPU time", key, "cpu")
            if name == "spilld":
                line("  preadv", key, "preadv")
                line("  xxh3", key, "xxh3")
                rest = [x["total"] - sum(v for k, v in x.items() if k not in ("total", "cpu")) for x in d[key]]
                print(f"    {'rest (header, mx.zeros + eval, python)':<44} {ms(rest)}")
            if name == "raw_split":
                line("  mx.zeros + eval", key, "alloc")
                line("  preadv", key, "read")
    n = b.shape.n_tensors
    print(f"  {f'mx.zeros+eval x{n}, step capacity rows':<46} {ms(d['alloc_capacity_s'])}")
    print(f"  {f'mx.zeros+eval x{n}, exact rows':<46} {ms(d['alloc_exact_s'])}")
    print(f"  {f'mx.zeros+eval x{n}, exact, mlx cache reused':<46} {ms(d['alloc_exact_reused_s'])}")
    return d


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark spilld save/load against an O_DIRECT ceiling, mlx-lm and mx.safetensors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=32, help="KVCache layers")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per layer (one update_and_fetch chunk)")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--dim", type=int, default=128, help="head dimension")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs of every arm")
    p.add_argument(
        "--dir",
        default=None,
        help="folder for the files (default: a fresh folder under /var/tmp, removed at the end; never /dev/shm)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long check that every arm and the diagnostics run: 2 layers x 2048 tokens (16 MiB), 1 run, warm loads only",
    )
    p.add_argument("--no-diag", action="store_true", help="skip the diagnostics phase")
    p.add_argument("--diag-only", action="store_true", help="run only the diagnostics phase (and the files it reads)")
    p.add_argument("--json", metavar="OUT", default=None, help="write every number to this JSON file")
    p.add_argument(
        "--sizes",
        default=None,
        help="load phase only, at each of these cache sizes (e.g. 256MiB,1GiB,4GiB; --tokens is derived from each)",
    )
    p.add_argument("--plot", metavar="PNG", default=None, help="with --sizes: draw load GB/s by size, one line an arm")
    p.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="draw --plot from a --sizes run's JSON (a machine without matplotlib)",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.tokens, a.runs = 2, 2048, 1  # 16 MiB: files take the O_DIRECT path
    return a


def parse_size(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def sizes_main(a: argparse.Namespace) -> int:
    """The load phase at several cache sizes, one after another (each size's files removed before the next)."""
    per_token = a.layers * 2 * a.heads * a.dim * 2
    rows = []
    for text in a.sizes.split(","):
        tokens = max(mlc.KVCache.step, parse_size(text) // per_token // mlc.KVCache.step * mlc.KVCache.step)
        shape = Shape(a.layers, tokens, a.heads, a.dim)
        folder = tempfile.mkdtemp(prefix="spilld-bench-", dir=a.dir or "/var/tmp")
        print(f"\n=== {text}: {tokens} tokens, live {shape.live_bytes / 2**20:.0f} MiB", flush=True)
        b = Bench(shape, folder, a.runs, build_caches(shape), list(range(tokens)))
        b.cold_ok = not a.smoke
        try:
            load = b.load_phase(b.write_load_files())
            rows.append({"size": text, "live_bytes": shape.live_bytes, "load_gbps": load, **report(b, {}, load)})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            del b
            clear()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": sys.argv, "machine": machine_info("/var/tmp"), "sizes": rows}, f, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        plot_sizes(rows, a.plot)
        print(f"plot: {a.plot}")
    return 0


def plot_sizes(rows: list[dict[str, Any]], path: str) -> None:
    """Load GB/s (median) by cache size, one line an arm, cold and warm side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    sizes = [r["live_bytes"] / 2**30 for r in rows]
    for ax, mode in zip(axes, ("cold", "warm"), strict=True):
        for arm in rows[0]["median_load_gbps"]:
            ys = [r["median_load_gbps"][arm][mode] for r in rows]
            if all(y != y for y in ys):
                continue  # NaN: an arm not run in this mode
            ax.plot(sizes, ys, marker="o", label=arm, linestyle="--" if arm in WARM_ONLY else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [r["size"] for r in rows])
        ax.set_title(f"{mode} load")
        ax.set_xlabel("cache size")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (median)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.replot and a.plot:
        with open(a.replot) as f:
            plot_sizes(json.load(f)["sizes"], a.plot)
        return 0
    if a.sizes:
        return sizes_main(a)
    shape = Shape(a.layers, a.tokens, a.heads, a.dim)
    if a.tokens % mlc.KVCache.step:
        print(f"note: {a.tokens} tokens is not a multiple of {mlc.KVCache.step}; mlx_lm will also save the padding")
    own_dir = a.dir is None
    folder = tempfile.mkdtemp(prefix="spilld-bench-", dir="/var/tmp") if own_dir else os.path.abspath(a.dir)
    os.makedirs(folder, exist_ok=True)
    info = machine_info(folder)
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    for k, v in info.items():
        print(f"{k:>14}: {v}")
    print(f"cache: {shape.layers} layers x KVCache, K and V float16 {shape.kv_shape}, live {shape.live_bytes} bytes")
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    caches = build_caches(shape)
    assert all(c.offset == shape.tokens for c in caches)
    print(f"built the cache in {time.perf_counter() - t0:.1f} s", flush=True)
    b = Bench(shape, folder, a.runs, caches, list(range(shape.tokens)))
    if a.smoke:
        b.cold_ok = False  # dropping the page cache would slow everything else on the machine, for no figure
    files: dict[str, str] = {}
    try:
        save: dict[str, list[float]] = {}
        load: dict[str, dict[str, list[float]]] = {}
        summary: dict[str, Any] = {}
        if not a.diag_only:
            save = b.save_phase()
        print("writing the load files", flush=True)
        files = b.write_load_files()
        if not a.diag_only:
            load = b.load_phase(files)
            if not b.cold_ok:
                print("NOTE: cold loads were skipped (drop_caches not permitted); cold ratios are NaN")
            summary = report(b, save, load)
        diag: dict[str, Any] = {}
        if a.diag_only or not a.no_diag:
            diag = report_diag(b, b.diag_phase(files, a.runs))
    finally:
        for p in files.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    print(f"\ntotal {elapsed:.0f} s")
    if a.json:
        doc = {
            "command": sys.argv,
            "machine": info,
            "shape": {"layers": a.layers, "tokens": a.tokens, "heads": a.heads, "dim": a.dim, "dtype": "float16"},
            "live_bytes": shape.live_bytes,
            "gb": GB,
            "runs": a.runs,
            "cold_loads": b.cold_ok,
            "save_gbps": save,
            "load_gbps": load,
            **summary,
            "diagnostics_s": diag,
            "elapsed_s": elapsed,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
