"""New mlx buffers for a load, made for the bytes about to be read into them: allocated without a zero fill
(``unfilled``, wherever mlx loads a .npy from a file object; else the caller zero-fills), transparent huge pages
asked for the large ones (``advise_huge``) and, for a manifest's buffers without them, the pages faulted in with
one call (``populate``). The two ``madvise`` calls are Linux's; elsewhere they do nothing.
"""

from __future__ import annotations

import io
import math
import mmap
import sys
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from . import fileio
from . import format as fmt

if TYPE_CHECKING:
    import mlx.core as mx

UNFILLED_MIN_BYTES = 256 * 1024  # buffers this large are allocated without a zero fill (``unfilled``)

_NPY_DESCR = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "uint16": "u2", "uint32": "u4", "uint64": "u8", "int16": "i2",
    "int32": "i4", "int64": "i8", "float16": "f2", "float32": "f4", "float64": "f8", "complex64": "c8",
    "bfloat16": "u2",  # allocated as uint16, then viewed (same buffer)
}  # fmt: skip
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 * 1024 * 1024  # x86-64 and arm64 Linux with 4 KiB pages
HUGE_PAGE_MIN_BYTES = 16 * 1024 * 1024  # new buffers this large ask for huge pages (at 4 MiB it measured no gain)
_madvise: Any = None  # libc's madvise once found; False where there is none
_populate_works = True  # False once the kernel refused MADV_POPULATE_WRITE (before 5.14)


def address(mv: memoryview) -> int:
    """Where a buffer's first byte is in memory."""
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        import ctypes

        _madvise = fileio.libc_call("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    return _madvise


def advise_huge(addr: int, nbytes: int) -> bool:
    """Ask for transparent huge pages over a new buffer's whole 2 MiB stretches (as numpy does for its arrays):
    a fault then maps 2 MiB, not 4 KiB. Called where the buffer is allocated, on one thread: the call changes
    the process's memory map, which stalls every other thread's page faults while it runs. False where it was
    not asked (a small buffer, another OS); where THP is off it is asked and has no effect."""
    madvise = _libc_madvise()
    hs, he = -(-addr // _HUGE_PAGE) * _HUGE_PAGE, (addr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if nbytes < HUGE_PAGE_MIN_BYTES or madvise is False or he <= hs:
        return False
    return bool(madvise(hs, he - hs, _MADV_HUGEPAGE) == 0)


def populate(addr: int, nbytes: int) -> None:
    """Fault in a buffer's pages with one call (``MADV_POPULATE_WRITE``): for a manifest's buffers in 4 KiB
    pages, which a block's rows fill a few pages here and a few there. Not for a whole file's (read front to
    back, its faults are cheaper than the call: 16 cores, 4 GiB, 7.9 GB/s without against 6.3 with). Anything
    it does not do (another OS, an older kernel) the reads' page faults do."""
    global _populate_works
    madvise = _libc_madvise()
    page = mmap.PAGESIZE
    start, end = -(-addr // page) * page, (addr + nbytes) // page * page
    if madvise is False or not _populate_works or end <= start:
        return
    if madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
        _populate_works = False  # EINVAL before 5.14: from now on the reads fault pages in


_unfilled_works: bool | None = None  # None: not tried yet in this process


class _Unwritten(io.RawIOBase):
    """A .npy "file" whose data ``mx.load`` asks to be read into its new buffer, and which writes nothing there:
    mlx's own loader allocates without a zero fill, so the only pass over the new memory is the read that fills it
    (its pages faulted in by the reads, or first: ``populate``)."""

    def __init__(self, shape: list[int], descr: str) -> None:
        d = descr if descr[0] == "|" else ("<" if sys.byteorder == "little" else ">") + descr
        text = f"{{'descr': '{d}', 'fortran_order': False, 'shape': ({''.join(f'{x}, ' for x in shape)}), }}"
        body = text.encode()
        pad = 64 - (10 + len(body) + 1) % 64
        self.head = b"\x93NUMPY\x01\x00" + (len(body) + pad + 1).to_bytes(2, "little") + body + b" " * pad + b"\n"
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset
        return self.pos

    def readinto(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        if self.pos < len(self.head):
            n = min(n, len(self.head) - self.pos)
            memoryview(b).cast("B")[:n] = self.head[self.pos : self.pos + n]
        self.pos += n
        return n


def unfilled(shape: list[int], dtype: str) -> mx.array | None:
    """An evaluated array of ``shape`` whose memory nothing has written (every byte must be written before it is
    returned to anyone); None for a small one, or where this mlx cannot (then the caller zero-fills)."""
    global _unfilled_works
    import mlx.core as mx

    from . import dtypes

    descr = _NPY_DESCR.get(dtype)
    if _unfilled_works is False or descr is None or fmt.DTYPE_SIZES[dtype] * math.prod(shape) < UNFILLED_MIN_BYTES:
        return None
    want = dtypes.dtype_of(dtype)
    try:
        arr = mx.load(cast(BinaryIO, _Unwritten(shape, descr)), format="npy")
        assert isinstance(arr, mx.array)
        if arr.dtype != want:
            arr = arr.view(want)
            mx.eval(arr)
        if list(arr.shape) != list(shape) or arr.dtype != want:
            raise ValueError(f"got {arr.shape} {arr.dtype}")
    except Exception:
        if _unfilled_works:  # it worked before: a real failure (out of memory)
            raise
        _unfilled_works = False  # an mlx without file-like loads: zero-filled buffers from now on
        return None
    _unfilled_works = True
    return arr
