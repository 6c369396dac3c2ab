"""``bytecopy.copy_into``: long copies through numpy, which releases the GIL (a slice assignment holds it)."""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import pytest

from spilld import bytecopy


@pytest.mark.parametrize("n", [0, 1, bytecopy.GIL_FREE_MIN_BYTES - 1, bytecopy.GIL_FREE_MIN_BYTES, 3 << 20])
def test_copy_into_copies_every_byte(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = np.copyto

    def recording(dst: Any, src: Any) -> None:
        calls.append(dst.nbytes)
        real(dst, src)

    monkeypatch.setattr(np, "copyto", recording)
    src = os.urandom(n + 5)
    dst = mmap.mmap(-1, n + 16)
    bytecopy.copy_into(memoryview(dst)[3 : 3 + n], memoryview(src)[5:])
    assert dst[3 : 3 + n] == src[5:] and dst[:3] == bytes(3) and dst[3 + n :] == bytes(13)
    assert calls == ([n] if n >= bytecopy.GIL_FREE_MIN_BYTES else [])  # long ones through numpy, not a slice


def test_copy_into_copies_from_typed_buffers_and_refuses_other_lengths() -> None:
    src = np.arange(100_000, dtype=np.float16)
    dst = bytearray(src.nbytes)
    bytecopy.copy_into(memoryview(dst), memoryview(src))
    assert bytes(dst) == src.tobytes()
    with pytest.raises(ValueError):
        bytecopy.copy_into(memoryview(dst)[1:], memoryview(src))
    with pytest.raises(ValueError, match="copy of"):  # numpy would broadcast one byte over the whole buffer
        bytecopy.copy_into(memoryview(dst), memoryview(b"x"))
