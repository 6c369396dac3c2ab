"""mlx-lm's drop-ins: they read what mlx-lm wrote, and never write spilld's format under a safetensors name."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import format as fmt
from spilld.compat import spilld_name
from spilld.loader import read_header
from tests.caches import fill, live, same


def _caches() -> list[Any]:
    return [fill(C.KVCache(), 11), fill(C.RotatingKVCache(8, keep=2), 11)]


def test_reads_what_mlx_lm_wrote(tmp_path: Any) -> None:
    cs = _caches()
    name = str(tmp_path / "theirs.safetensors")
    C.save_prompt_cache(name, cs, {"model": "tiny"})
    got, meta = spilld.load_prompt_cache(name, return_metadata=True)
    assert meta == {"model": "tiny"}
    assert [type(c) for c in got] == [type(c) for c in cs]
    assert all(same(live(a), live(b)) for a, b in zip(got, cs, strict=True))
    assert all(same(live(a), live(b)) for a, b in zip(spilld.load_prompt_cache(name), cs, strict=True))


def test_a_safetensors_name_gets_spillds_extension(tmp_path: Any) -> None:
    cs = _caches()
    name = str(tmp_path / "prompt.safetensors")
    written = spilld.save_prompt_cache(name, cs, {"model": "tiny", "note": "héllo"})
    assert written == str(tmp_path / "prompt.spilld") and os.listdir(tmp_path) == ["prompt.spilld"]
    with open(written, "rb") as f:
        assert f.read(len(fmt.MAGIC)) == fmt.MAGIC
    with pytest.raises(Exception):  # noqa: B017  (what a safetensors reader makes of it: not a safetensors file)
        mx.load(written, format="safetensors")
    got, meta = spilld.load_prompt_cache(name, return_metadata=True)  # the name the caller used still loads
    assert meta == {"model": "tiny", "note": "héllo"}
    assert all(same(live(a), live(b)) for a, b in zip(got, cs, strict=True))
    assert read_header(written).tokens == []


def test_other_names_are_kept(tmp_path: Any) -> None:
    name = str(tmp_path / "prompt.cache")
    assert spilld.save_prompt_cache(name, _caches()) == name and os.listdir(tmp_path) == ["prompt.cache"]
    assert spilld_name(name) == name
    assert len(spilld.load_prompt_cache(name)) == 2


def test_of_a_name_and_its_twin_the_later_write_loads(tmp_path: Any) -> None:
    """Found in review: on an mtime tie (a coarse clock: both saves in one tick) the twin was read, though mlx-lm
    had saved under the name after it. A save under the name removes the file there, so a tie goes to the name."""
    name, twin = str(tmp_path / "p.safetensors"), spilld_name(str(tmp_path / "p.safetensors"))
    old, new = [fill(C.KVCache(), 5)], [fill(C.KVCache(), 9, seed=3)]
    C.save_prompt_cache(name, old)
    spilld.save_prompt_cache(name, new)
    assert not os.path.exists(name) and spilld.load_prompt_cache(name)[0].offset == 9  # the older file replaced
    C.save_prompt_cache(name, old)  # mlx-lm saves under the name after us, in the same clock tick
    os.utime(name, ns=(0, os.stat(twin).st_mtime_ns))
    assert spilld.load_prompt_cache(name)[0].offset == 5
    os.utime(twin, ns=(0, os.stat(name).st_mtime_ns + 10**9))  # a twin newer (an older spilld left both)
    assert spilld.load_prompt_cache(name)[0].offset == 9
