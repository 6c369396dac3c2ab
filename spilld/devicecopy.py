"""Copies out of a GPU's memory by its copy engine, not by a CPU thread.

On mlx's CUDA backend every array lives in CUDA managed memory. A CPU thread that reads one (a memcpy, a hash)
faults its pages over to the host, and those faults stall the engine's kernels: decode slows while a spill reads
the arrays, even from a thread that holds no lock and no GIL (docs/benchmarks.md, the GPU sections). The GPU's copy
engine reads the same bytes over PCIe with no fault and no migration. ``copier()`` gives the process's copier when
mlx's CUDA runtime is loaded here, and None otherwise (macOS, mlx's CPU build, or ``SPILLD_DEVICE_COPY=0``), in
which case callers copy with the CPU as before.

The runtime is the copy mlx loaded (found in ``/proc/self/maps``): a second CUDA runtime in one process is not
safe. Each thread copies on a non-blocking CUDA stream of its own, so no copy waits for, or holds up, the
engine's stream; ctypes releases the GIL for the length of each CUDA call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

ENV = "SPILLD_DEVICE_COPY"  # "0": never copy by the GPU (a benchmark's other arm; a way out should a driver misbehave)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the driver tells managed, device and host pointers apart
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit wait on the legacy default stream
_MANAGED, _DEVICE = 3, 2  # cudaMemoryType values of cudaPointerAttributes.type


class _Attr(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("dptr", ctypes.c_void_p),
        ("hptr", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),  # room for fields a newer runtime writes: it fills the whole struct
    ]


class DeviceCopyError(RuntimeError):
    """A CUDA call of a copy failed (its error number in the message); the caller's copy fails with it."""


def address(buf: memoryview) -> int:
    """The address of a contiguous buffer's first byte."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


class CudaCopier:
    """Copies from GPU (managed or device) memory into host memory with ``cudaMemcpyAsync`` on the calling
    thread's own stream, then waits for that stream alone."""

    def __init__(self, rt: Any) -> None:
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        rt.cudaPointerGetAttributes.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._rt = rt
        self._local = threading.local()

    def _call(self, what: str, rc: int) -> None:
        if rc != 0:
            self._rt.cudaGetLastError()  # clear it: a sticky-free error would fail the next, unrelated call
            raise DeviceCopyError(f"{what} failed with CUDA error {rc}")

    def on_device(self, buf: memoryview) -> bool:
        """Whether ``buf``'s bytes are GPU memory (managed or device), which this copier should move."""
        attr = _Attr()
        if self._rt.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(address(buf))) != 0:
            self._rt.cudaGetLastError()  # (an address CUDA never saw: plain host memory)
            return False
        return attr.type in (_MANAGED, _DEVICE)

    def _stream(self) -> ctypes.c_void_p:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = ctypes.c_void_p()
            self._call(
                "cudaStreamCreateWithFlags",
                self._rt.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING),
            )
            self._local.stream = stream  # kept for the thread's life: a stream is cheap, making one is not
        return stream

    def copy(self, dst: memoryview, src: memoryview) -> None:
        """Copy ``src`` (GPU memory) into ``dst`` (host memory, the same length); returns once the bytes landed."""
        n = dst.nbytes
        stream = self._stream()
        rt = self._rt
        self._call("cudaMemcpyAsync", rt.cudaMemcpyAsync(address(dst), address(src), n, _MEMCPY_DEFAULT, stream))
        self._call("cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))


_lock = threading.Lock()
_found: list[CudaCopier | None] = []  # found once a process: [] not looked for yet


def _loaded_runtime() -> str | None:
    """The path of the CUDA runtime this process has loaded, if any (Linux; mlx's CUDA build loads one)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:  # no /proc (macOS): no CUDA either
        return None
    return paths[0] if paths else None


def copier() -> CudaCopier | None:
    """This process's GPU copier, or None where copies are the CPU's (looked for once a process; never loads a
    runtime itself: mlx's CUDA build has loaded its own by the time an array exists to copy)."""
    if os.environ.get(ENV) == "0":
        return None
    if _found:
        return _found[0]
    with _lock:
        if not _found:
            _found.append(_look())
        return _found[0]


def _look() -> CudaCopier | None:
    import mlx.core as mx

    if not mx.cuda.is_available():  # (macOS, mlx's CPU build)
        return None
    path = _loaded_runtime()
    if path is None:
        return None
    try:
        return CudaCopier(ctypes.CDLL(path))
    except (OSError, AttributeError):  # not a runtime we can drive: the CPU copies
        return None
