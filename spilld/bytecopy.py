"""Bulk byte copies that let other threads run.

A slice assignment between two buffers (``dst[a:b] = src``) holds the GIL for its whole memcpy: 8 MiB takes 1-2 ms,
more where the source's pages must fault in (CUDA managed memory), and an engine's decode thread, which needs the
GIL between two kernels, waits that long. numpy's copy of a byte array releases the GIL (measured: a Python loop's
p99 iteration gap 0.27 ms alone, 1.9-2.8 ms beside a thread copying 8 MiB by slice assignment, 0.53 ms beside one
copying with ``np.copyto``; docs/benchmarks.md, the GPU decode section).
"""

from __future__ import annotations

import numpy as np

GIL_FREE_MIN_BYTES = 64 * 1024  # shorter copies by slice assignment: numpy's call costs more than they hold the GIL


def copy_into(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (contiguous byte buffers of the same length), releasing the GIL when it is long."""
    n = dst.nbytes
    if src.nbytes != n:
        raise ValueError(f"copy of {src.nbytes} bytes into {n}")
    if n < GIL_FREE_MIN_BYTES:
        dst.cast("B")[:] = src.cast("B")
        return
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
