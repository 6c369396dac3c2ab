"""``devicecopy``: copies out of a GPU's memory by its copy engine (mlx on CUDA), the CPU's copy everywhere else.

The CUDA tests run where mlx's CUDA build has the GPU (the GPU host, pytest carried there as a wheel); on a
machine without one they are skipped, and the tests that a CPU machine can run check that nothing is looked for,
loaded or used there.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from spilld import bytecopy, devicecopy

CUDA = bool(mx.cuda.is_available())
needs_cuda = pytest.mark.skipif(not CUDA, reason="mlx's CUDA build and a GPU")


def _gpu_array(nbytes: int, seed: int) -> mx.array:
    mx.random.seed(seed)
    a = mx.random.randint(0, 255, (nbytes,), dtype=mx.uint8)
    mx.eval(a)
    return a


@pytest.mark.skipif(CUDA, reason="a machine without CUDA")
def test_without_cuda_there_is_no_copier_and_no_runtime_is_loaded(asked: None) -> None:
    assert devicecopy.copier() is None
    assert devicecopy._loaded_driver() is None  # nothing loaded a CUDA driver behind mlx's back


@pytest.mark.parametrize("value", [None, "0", "yes", "1"])
def test_the_copier_is_off_unless_asked_for(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    found = object()  # what the look would find on a CUDA machine
    monkeypatch.setattr(devicecopy, "_found", [found])
    if value is None:
        monkeypatch.delenv(devicecopy.ENV, raising=False)
    else:
        monkeypatch.setenv(devicecopy.ENV, value)
    assert devicecopy.copier() is (found if value == "1" else None)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devicecopy.ENV, "1")


@needs_cuda
def test_on_cuda_a_gpu_array_is_copied_by_the_copy_engine_byte_for_byte(
    asked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = devicecopy.copier()
    assert gpu is not None
    a = _gpu_array(12 << 20, seed=3)
    src = memoryview(a)  # type: ignore[arg-type]
    assert gpu.on_device(src) and not gpu.on_device(memoryview(bytearray(1 << 20)))
    copies: list[int] = []
    real = gpu.copy
    monkeypatch.setattr(gpu, "copy", lambda d, s: (copies.append(s.nbytes), real(d, s)))
    dst = bytearray(src.nbytes + 7)
    bytecopy.copy_into(memoryview(dst)[7:], src.cast("B")[0 : src.nbytes])
    assert copies == [src.nbytes]  # the GPU's copy, not numpy's
    assert bytes(dst[7:]) == np.array(a).tobytes() and dst[:7] == bytes(7)
    half = src.nbytes // 2 + 3  # an unaligned piece of an array, as a segment's fill takes them
    out = bytearray(half)
    bytecopy.copy_into(memoryview(out), src.cast("B")[3 : 3 + half])
    assert bytes(out) == np.array(a).tobytes()[3 : 3 + half]


@needs_cuda
def test_on_cuda_host_memory_is_still_copied_by_the_cpu(asked: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = devicecopy.copier()
    assert gpu is not None
    monkeypatch.setattr(gpu, "copy", lambda d, s: pytest.fail("a host buffer went to the GPU's copy"))
    src = os.urandom(1 << 20)
    dst = bytearray(len(src))
    bytecopy.copy_into(memoryview(dst), memoryview(src))
    assert bytes(dst) == src


@needs_cuda
def test_on_cuda_a_failed_copy_raises_a_typed_error_and_the_next_copy_works(asked: None) -> None:
    gpu = devicecopy.copier()
    assert gpu is not None
    a = _gpu_array(1 << 20, seed=4)
    with pytest.raises(devicecopy.DeviceCopyError):
        gpu._call("cuMemcpyAsync", 1)  # an error number as CUDA returns it
    dst = bytearray(1 << 20)
    gpu.copy(memoryview(dst), memoryview(a))  # type: ignore[arg-type]
    assert bytes(dst) == np.array(a).tobytes()
