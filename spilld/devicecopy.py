"""Copies out of a GPU's memory by its copy engine, not by a CPU thread.

On mlx's CUDA backend every array lives in CUDA managed memory. A CPU thread that reads one (a memcpy, a hash)
faults its pages over to the host, and those faults stall the engine's kernels: decode slows while a spill reads
the arrays, even from a thread that holds no lock and no GIL (docs/benchmarks.md, the GPU sections). The GPU's copy
engine reads the same bytes over PCIe with no fault and no migration. ``copier()`` gives the process's copier when
mlx has loaded the CUDA driver here and ``SPILLD_DEVICE_COPY=1`` asks for it, and None otherwise (macOS, mlx's CPU
build, the variable unset), in which case callers copy with the CPU as before. It is opt-in: its measured effect
on decode is in docs/benchmarks.md ("GPU: copy-out by the copy engine").

It drives the driver library mlx loaded (found in ``/proc/self/maps``; mlx links its CUDA runtime statically, so
the driver is what the process shares), in each device's primary context, the one mlx's runtime uses. Each thread
copies on a non-blocking stream of its own, so no copy waits for, or holds up, the engine's stream; ctypes releases
the GIL for the length of each CUDA call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

ENV = "SPILLD_DEVICE_COPY"  # "1": copy by the GPU where it can (opt-in until the GPU host's runs say it pays)
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit wait on the legacy default stream
_ATTR_MEMORY_TYPE, _ATTR_IS_MANAGED, _ATTR_DEVICE_ORDINAL = 2, 8, 9  # CUpointer_attribute values
_MEMORYTYPE_DEVICE = 2  # CUmemorytype


class DeviceCopyError(RuntimeError):
    """A CUDA call of a copy failed (its error number in the message); the caller's copy fails with it."""


def address(buf: memoryview) -> int:
    """The address of a contiguous buffer's first byte."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


class CudaCopier:
    """Copies from GPU (managed or device) memory into host memory with ``cuMemcpyAsync`` on the calling
    thread's own stream, then waits for that stream alone. Driven through the CUDA driver (``libcuda``), the one
    library every CUDA runtime in the process shares (mlx links its runtime statically)."""

    def __init__(self, cu: Any) -> None:
        cu.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        cu.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.c_void_p, ctypes.c_int]
        cu.cuStreamCreate.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self._cu = cu
        self._local = threading.local()
        self._contexts: dict[int, ctypes.c_void_p] = {}  # each device's primary context (mlx's too)

    def _call(self, what: str, rc: int) -> None:
        if rc != 0:
            raise DeviceCopyError(f"{what} failed with CUDA error {rc}")

    def _attribute(self, attr: int, ptr: int) -> int | None:
        out = ctypes.c_uint64(0)
        if self._cu.cuPointerGetAttribute(ctypes.byref(out), attr, ptr) != 0:
            return None  # (an address CUDA never saw: plain host memory)
        return out.value

    def device_of(self, buf: memoryview) -> int | None:
        """The GPU whose memory (managed or device) holds ``buf``'s bytes, or None for host memory."""
        if not getattr(self._local, "has_context", False):  # (a thread's first query: device 0's, as mlx's default)
            self._set_context(0)
            self._local.has_context = True
        ptr = address(buf)
        managed = self._attribute(_ATTR_IS_MANAGED, ptr)
        if not managed and self._attribute(_ATTR_MEMORY_TYPE, ptr) != _MEMORYTYPE_DEVICE:
            return None
        return self._attribute(_ATTR_DEVICE_ORDINAL, ptr) or 0

    def on_device(self, buf: memoryview) -> bool:
        """Whether ``buf``'s bytes are GPU memory, which this copier should move."""
        return self.device_of(buf) is not None

    def _set_context(self, device: int) -> None:
        """Make ``device``'s primary context (the one mlx's runtime uses) this thread's current one."""
        if device not in self._contexts:
            ctx = ctypes.c_void_p()
            self._call("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
            self._contexts.setdefault(device, ctx)  # (held for the process's life, as mlx holds it)
        self._call("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._contexts[device]))

    def _stream(self, device: int) -> ctypes.c_void_p:
        """This thread's stream on ``device``, its primary context made current first."""
        streams: dict[int, ctypes.c_void_p] = self._local.__dict__.setdefault("streams", {})
        self._set_context(device)
        if device not in streams:
            stream = ctypes.c_void_p()
            self._call("cuStreamCreate", self._cu.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING))
            streams[device] = stream  # kept for the thread's life: a stream is cheap, making one is not
        return streams[device]

    def copy(self, dst: memoryview, src: memoryview) -> None:
        """Copy ``src`` (GPU memory) into ``dst`` (host memory, the same length); returns once the bytes landed."""
        device = self.device_of(src)
        stream = self._stream(device or 0)
        cu = self._cu
        self._call("cuMemcpyAsync", cu.cuMemcpyAsync(address(dst), address(src), dst.nbytes, stream))
        self._call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))


_lock = threading.Lock()
_found: list[CudaCopier | None] = []  # found once a process: [] not looked for yet


def _loaded_driver() -> str | None:
    """The path of the CUDA driver library this process has loaded, if any (Linux; mlx's CUDA build loads it)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "/libcuda.so" in line})
    except OSError:  # no /proc (macOS): no CUDA either
        return None
    return paths[0] if paths else None


def copier() -> CudaCopier | None:
    """This process's GPU copier, or None where copies are the CPU's (looked for once a process; never loads a
    driver itself: mlx's CUDA build has loaded it by the time an array exists to copy)."""
    if os.environ.get(ENV) != "1":
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
    path = _loaded_driver()
    if path is None:
        return None
    try:
        return CudaCopier(ctypes.CDLL(path))
    except (OSError, AttributeError):  # not a runtime we can drive: the CPU copies
        return None
